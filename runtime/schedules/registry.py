"""Build a schedule by name: the one place that knows every schedule family and its options.

    >>> build_schedule("1f1b", num_ranks=2, num_microbatches=4).name
    '1f1b'
    >>> schedule_names()  # doctest: +NORMALIZE_WHITESPACE
    ('naive', 'gpipe', '1f1b', 'interleaved_1f1b', 'looped_bfs', 'zb_h1', 'zb_h2', 'zb_v', 'dualpipev',
     'dualpipe', 'chimera', 'pipedream', 'pipedream_2bw', 'pipemare')
    >>> splits_backward("dualpipev"), default_stages_per_rank("zb_v")
    (True, 2)
    >>> schedule_names(asynchronous=False)[-1]
    'chimera'

"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping
from typing import NamedTuple

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.asynchronous import ASYNC_SCHEDULES, pipedream, pipedream_2bw, pipemare
from autopar.runtime.schedules.chimera import chimera
from autopar.runtime.schedules.dualpipe import dualpipe, dualpipev
from autopar.runtime.schedules.gpipe import gpipe
from autopar.runtime.schedules.interleaved import interleaved_1f1b, looped_bfs
from autopar.runtime.schedules.naive import naive
from autopar.runtime.schedules.one_f_one_b import one_f_one_b
from autopar.runtime.schedules.zb_v import zb_v
from autopar.runtime.schedules.zero_bubble import zb_h1, zb_h2

__all__ = ["build_schedule", "schedule_names", "splits_backward", "default_stages_per_rank", "model_replicas"]

logger = logging.getLogger(__name__)


class _Family(NamedTuple):
    """A generator, the stages per rank (``num_virtual``) it accepts, and whether it splits backward."""

    build: Callable[..., Schedule]
    fixed: int | None  # the only num_virtual accepted, or None when it is an option
    minimum: int = 1  # for an option: the least num_virtual
    default: int | None = None  # for an option: used when num_virtual is not given
    split_backward: bool = False  # B (input gradient) and W (weight gradient) run apart
    compile_virtual: int | None = None  # for an option: what compile uses when num_virtual is not given
    replicas: int = 1  # model replicas the stages form (two pipelines in opposite directions: 2)


_FAMILIES: Mapping[str, _Family] = types.MappingProxyType({
    "naive": _Family(naive, fixed=1),
    "gpipe": _Family(gpipe, fixed=1),
    "1f1b": _Family(one_f_one_b, fixed=1),
    "interleaved_1f1b": _Family(interleaved_1f1b, fixed=None, minimum=2, compile_virtual=2),
    # (the generator's own default is the classic one stage per rank; compile loops twice)
    "looped_bfs": _Family(looped_bfs, fixed=None, minimum=1, default=1, compile_virtual=2),
    "zb_h1": _Family(zb_h1, fixed=1, split_backward=True),
    "zb_h2": _Family(zb_h2, fixed=1, split_backward=True),
    "zb_v": _Family(zb_v, fixed=2, split_backward=True),
    "dualpipev": _Family(dualpipev, fixed=2, split_backward=True),
    "dualpipe": _Family(dualpipe, fixed=1, split_backward=True, replicas=2),  # one stage per rank per replica
    "chimera": _Family(chimera, fixed=1, replicas=2),  # one stage per rank in each of its two replicas
    "pipedream": _Family(pipedream, fixed=1),
    "pipedream_2bw": _Family(pipedream_2bw, fixed=1),
    "pipemare": _Family(pipemare, fixed=1),
})


def schedule_names(*, asynchronous: bool = True) -> tuple[str, ...]:
    """Every name :func:`build_schedule` accepts (only the synchronous ones if ``asynchronous=False``)."""
    return tuple(n for n in _FAMILIES if asynchronous or n not in ASYNC_SCHEDULES)


def _family(name: str) -> _Family:
    family = _FAMILIES.get(name)
    if family is None:
        raise ScheduleError(f"unknown schedule {name!r}", where="schedule=", fix=f"use one of {', '.join(schedule_names())}")
    return family


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` runs backward as B (input gradient) and W (weight gradient) apart."""
    return _family(name).split_backward


def model_replicas(name: str) -> int:
    """How many copies of the model schedule ``name`` runs (Chimera and DualPipe: 2, one per direction)."""
    return _family(name).replicas


def default_stages_per_rank(name: str, requested: int | None = None) -> int:
    """Stages per pp rank compile uses for ``name``: ``requested`` if given, else the family's own."""
    if requested is not None:
        return requested
    family = _family(name)
    return family.fixed if family.fixed is not None else family.compile_virtual


def build_schedule(
    name: str, *, num_ranks: int, num_microbatches: int, num_virtual: int | None = None
) -> Schedule:
    """The ``name`` schedule for ``num_ranks`` ranks, ``num_microbatches`` microbatches.

    ``num_virtual`` is the number of stages per rank (per replica, for ``chimera``). ``None`` means
    the family's own: 1, or 2 for ``zb_v``, which only has a V of two; ``interleaved_1f1b`` needs
    it given, at least 2. The asynchronous schedules build a stream of one batch here; see
    :mod:`autopar.runtime.schedules.asynchronous` for longer streams.
    """
    family = _family(name)
    if family.fixed is not None:
        if num_virtual not in (None, family.fixed):
            others = "interleaved_1f1b or looped_bfs" if family.fixed == 1 else "interleaved_1f1b"
            if family.fixed == 2:
                others = "zb_h1 or zb_h2 for one stage per rank, interleaved_1f1b for more"
            raise ScheduleError(
                f"schedule {name!r} runs exactly {family.fixed} stage(s) per rank, got num_virtual={num_virtual}",
                where=f"schedule {name!r}, num_virtual={num_virtual}",
                fix=f"drop num_virtual (or pass {family.fixed}), or use {others} for other stage counts",
            )
        logger.debug("building %s for %s ranks, %s microbatches", name, num_ranks, num_microbatches)
        return family.build(num_ranks=num_ranks, num_microbatches=num_microbatches)
    virtual = family.default if num_virtual is None else num_virtual
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < family.minimum:
        other = ", or use '1f1b' for one stage per rank" if name == "interleaved_1f1b" else ""
        raise ScheduleError(
            f"schedule {name!r} needs num_virtual >= {family.minimum} stages per rank, got {num_virtual!r}",
            where=f"schedule {name!r}, num_virtual={num_virtual!r}",
            fix=f"pass num_virtual={family.minimum} or more{other}",
        )
    logger.debug("building %s for %s ranks, %s microbatches, %s stages per rank",
                 name, num_ranks, num_microbatches, virtual)
    return family.build(num_ranks=num_ranks, num_microbatches=num_microbatches, num_virtual=virtual)
