"""Every schedule family in one table: its generator and the facts the rest of autopar reads.

Nothing outside this module lists family names: the lowering asks :func:`family` whether a
schedule splits backward or replicates stages, the planner which families it searches and which
have closed forms, options and the Plan which names are valid.

    >>> build_schedule("1f1b", num_ranks=2, num_microbatches=4).name
    '1f1b'
    >>> schedule_names()  # doctest: +NORMALIZE_WHITESPACE
    ('naive', 'gpipe', '1f1b', 'interleaved_1f1b', 'looped_bfs', 'zb_h1', 'zb_h2', 'zb_v', 'dualpipev',
     'dualpipe', 'chimera', 'pipedream', 'pipedream_2bw', 'pipemare')
    >>> splits_backward("dualpipev"), default_stages_per_rank("zb_v"), default_stages_per_rank("looped_bfs")
    (True, 2, 2)
    >>> schedule_names(asynchronous=False)[-1]
    'chimera'
    >>> family("zb_v").closed_form.placement(2, 2), family("1f1b").closed_form.bubble(4, 8, 1)
    ((0, 1, 1, 0), 0.2727272727272727)

"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping
from typing import NamedTuple

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.asynchronous import pipedream, pipedream_2bw, pipemare
from autopar.runtime.schedules.chimera import chimera
from autopar.runtime.schedules.closed_form import ClosedForm, closed_forms_markdown
from autopar.runtime.schedules.dualpipe import dualpipe, dualpipev
from autopar.runtime.schedules.gpipe import gpipe
from autopar.runtime.schedules.interleaved import interleaved_1f1b, looped_bfs
from autopar.runtime.schedules.naive import naive
from autopar.runtime.schedules.one_f_one_b import one_f_one_b
from autopar.runtime.schedules.zb_v import zb_v
from autopar.runtime.schedules.zero_bubble import zb_h1, zb_h2

__all__ = ["Family", "ClosedForm", "family", "build_schedule", "schedule_names", "splits_backward",
           "default_stages_per_rank", "planner_schedules", "closed_forms_table", "ASYNC_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES"]

logger = logging.getLogger(__name__)


class Family(NamedTuple):
    """One schedule family: its generator and what every other module reads of it (its closed forms:
    :attr:`closed_form`)."""

    build: Callable[..., Schedule]
    stages_per_rank: int = 1  # num_virtual when none is given (per replica): compile, plan and build_schedule
    fixed: bool = True  # stages_per_rank is the only num_virtual accepted; else it is an option >= minimum
    minimum: int = 1
    split_backward: bool = False  # B (input gradient) and W (weight gradient) run apart
    asynchronous: bool = False  # updates without a flush (an endless stream, runtime/execution/async_pipeline.py)
    replicas: int = 1  # model replicas the stages come in (Chimera: a second pipeline the other way)
    peak_grows: bool = False  # in-flight peak grows with every microbatch (else steady by 2·pp microbatches)
    bounded: bool = False  # planner/pipeline_bound.py's lower bound holds (one replica, one F, B, W each)
    searched: int | None = None  # its place in the planner's default search (None: only when asked for)
    closed_form: ClosedForm | None = None  # placement, step, bubble and peaks in p, m, v (closed_form.py)


def _in_order(pp: int, v: int) -> tuple[int, ...]:
    return tuple(s % pp for s in range(pp * v))


def _v_shape(pp: int, v: int) -> tuple[int, ...]:
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(pp * v))


def _two_replicas(pp: int, v: int) -> tuple[int, ...]:
    """Chimera's and DualPipe's: the down replica on ranks 0..p-1, the up one back on p-1..0."""
    return _v_shape(pp, 2 * v)


_ONE_BATCH = dict(step="3*(m + p - 1)", busy="3*m", note="one batch of the stream")
_V_STEP = dict(step="Max(6*m + p - 1, 4*m + 4*p - 2)", busy="6*m")
_HALVES = "Piecewise((ceiling(m/2) + 1 + r, r < p/2), (floor(m/2) + p - r, True))"  # even mbs down, odd up

#: Every family: its generator, its facts, and its closed forms (the unit: runtime/schedules/closed_form.py).
_FAMILIES: Mapping[str, Family] = types.MappingProxyType({
    "naive": Family(naive, bounded=True, closed_form=ClosedForm(_in_order, step="3*p*m", busy="3*m", peak="1")),
    "gpipe": Family(gpipe, peak_grows=True, bounded=True, searched=3,
                    closed_form=ClosedForm(_in_order, step="3*(m + p - 1)", busy="3*m", peak="m")),
    "1f1b": Family(one_f_one_b, bounded=True, searched=0, closed_form=ClosedForm(
        _in_order, step="3*(m + p - 1)", busy="3*m", peak="p - r",
        requires=("m >= p", "1f1b needs num_microbatches >= {p}"))),
    "interleaved_1f1b": Family(interleaved_1f1b, stages_per_rank=2, fixed=False, minimum=2, bounded=True, searched=1,
                               closed_form=ClosedForm(
        _in_order, step="3*(m*v + p - 1)", busy="3*m*v", peak="Min(m*v, 2*(p - r - 1) + (v - 1)*p + 1)",
        requires=("Eq(Mod(m, p), 0)", "interleaved_1f1b needs num_microbatches to be a multiple of {p}"))),
    "looped_bfs": Family(looped_bfs, stages_per_rank=2, fixed=False, peak_grows=True, bounded=True,
                         closed_form=ClosedForm(_in_order, step="3*(v*Max(m, p) + Min(m, p) - 1)", busy="3*m*v",
                                                peak="m*v")),
    "zb_h1": Family(zb_h1, split_backward=True, bounded=True, searched=2, closed_form=ClosedForm(
        _in_order, step="Max(3*m + p - 1, 2*m + 2*p - 1)", busy="3*m", peak="Min(m, p)")),
    "zb_h2": Family(zb_h2, split_backward=True, bounded=True, closed_form=ClosedForm(
        _in_order, step="Max(3*m + p - 1, 2*p + 1 + floor(5*(m - 1)/2))", busy="3*m", peak="Min(m, 2*p - 1)")),
    "zb_v": Family(zb_v, stages_per_rank=2, split_backward=True, bounded=True, searched=4, closed_form=ClosedForm(
        _v_shape, **_V_STEP, peak="Min(2*p, 2*m, m + r + 1)")),
    "dualpipev": Family(dualpipev, stages_per_rank=2, split_backward=True, closed_form=ClosedForm(
        _v_shape, **_V_STEP, peak="Min(2*p + 1, 2*m, m + r + 1)", step_holds="(m <= p) | (m >= 2*p)",
        note="between p and 2p microbatches (its order built for 2p, then cut) the step is irregular")),
    "dualpipe": Family(dualpipe, split_backward=True, replicas=2, closed_form=ClosedForm(  # a stage per rank per replica
        _two_replicas, step="3*m + p/2 - 1", busy="3*m", peak=f"Min(p + 1, m, {_HALVES})",
        step_holds="Eq(Mod(m, 2), 0) & (m >= 2*p)",
        requires=("Eq(Mod(p, 2), 0)", "dualpipe needs an even number of ranks, got p={p} with m"))),
    "chimera": Family(chimera, replicas=2, closed_form=ClosedForm(  # one stage per rank in each of its two replicas
        _two_replicas, step="3*p - 4 + 4*ceiling(m/2) + (ceiling(2*ceiling(m/2)/p) - 1)*Max(2*p - 3, p)", busy="3*m",
        peak=f"Min(m, p + Min(1, r, p - 1 - r), {_HALVES})", step_holds="Eq(Mod(p, 2), 0)",
        peak_holds="Eq(Mod(p, 2), 0)", note="greedy list scheduling: read off the simulator, checked on the grid")),
    "pipedream": Family(pipedream, asynchronous=True,
                        closed_form=ClosedForm(_in_order, **_ONE_BATCH, peak="Min(p - r, m)")),
    "pipedream_2bw": Family(pipedream_2bw, asynchronous=True, closed_form=ClosedForm(
        _in_order, **_ONE_BATCH, peak="p - r", requires=("m >= p", "pipedream_2bw needs num_microbatches >= {p}"))),
    "pipemare": Family(pipemare, asynchronous=True,
                       closed_form=ClosedForm(_in_order, **_ONE_BATCH, peak="Min(p - r, m)")),
})

ASYNC_SCHEDULES = tuple(n for n, f in _FAMILIES.items() if f.asynchronous)
SPLIT_BACKWARD_SCHEDULES = tuple(n for n, f in _FAMILIES.items() if f.split_backward)


def closed_forms_table() -> str:
    """Every family's closed forms as the markdown table docs/schedules.md prints (tests/docs compare them)."""
    return closed_forms_markdown({name: row.closed_form for name, row in _FAMILIES.items()})


def schedule_names(*, asynchronous: bool = True) -> tuple[str, ...]:
    """Every name :func:`build_schedule` accepts (only the synchronous ones if ``asynchronous=False``)."""
    return tuple(n for n, f in _FAMILIES.items() if asynchronous or not f.asynchronous)


def family(name: str) -> Family:
    """The table row of schedule ``name``; ScheduleError naming the known ones otherwise."""
    row = _FAMILIES.get(name)
    if row is None:
        raise ScheduleError(f"unknown schedule {name!r}", where="schedule=", fix=f"use one of {', '.join(schedule_names())}")
    return row


def planner_schedules() -> tuple[tuple[str, int], ...]:
    """(name, stages per rank) of the families the planner searches by default, in its order."""
    searched = sorted((f.searched, n) for n, f in _FAMILIES.items() if f.searched is not None)
    return tuple((n, _FAMILIES[n].stages_per_rank) for _, n in searched)


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` runs backward as B (input gradient) and W (weight gradient) apart."""
    return family(name).split_backward


def default_stages_per_rank(name: str, requested: int | None = None) -> int:
    """Stages per pp rank of ``name``: ``requested`` if given, else the family's own (one default for all)."""
    return family(name).stages_per_rank if requested is None else requested


def _check_virtual(name: str, row: Family, num_virtual) -> int:
    if row.fixed:
        if num_virtual not in (None, row.stages_per_rank):
            others = "interleaved_1f1b or looped_bfs"
            if row.stages_per_rank == 2:
                others = "zb_h1 or zb_h2 for one stage per rank, interleaved_1f1b for more"
            raise ScheduleError(
                f"schedule {name!r} runs exactly {row.stages_per_rank} stage(s) per rank, got num_virtual={num_virtual}",
                where=f"schedule {name!r}, num_virtual={num_virtual}",
                fix=f"drop num_virtual (or pass {row.stages_per_rank}), or use {others} for other stage counts",
            )
        return row.stages_per_rank
    virtual = row.stages_per_rank if num_virtual is None else num_virtual
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < row.minimum:
        other = ", or use '1f1b' for one stage per rank" if row.minimum > 1 else ""
        raise ScheduleError(
            f"schedule {name!r} needs num_virtual >= {row.minimum} stages per rank, got {num_virtual!r}",
            where=f"schedule {name!r}, num_virtual={num_virtual!r}",
            fix=f"pass num_virtual={row.minimum} or more{other}",
        )
    return virtual


def build_schedule(
    name: str, *, num_ranks: int, num_microbatches: int, num_virtual: int | None = None
) -> Schedule:
    """The ``name`` schedule for ``num_ranks`` ranks, ``num_microbatches`` microbatches.

    ``num_virtual`` is the number of stages per rank (per replica, for ``chimera``); ``None`` means
    the family's own (:attr:`Family.stages_per_rank`: 2 for ``interleaved_1f1b``, ``looped_bfs``,
    ``zb_v`` and ``dualpipev``, else 1), as compile and plan use it. The asynchronous schedules build a
    stream of one batch here; see :mod:`autopar.runtime.schedules.asynchronous` for longer streams.
    """
    row = family(name)
    virtual = _check_virtual(name, row, num_virtual)
    logger.debug("building %s for %s ranks, %s microbatches, %s stages per rank",
                 name, num_ranks, num_microbatches, virtual)
    if row.fixed:
        return row.build(num_ranks=num_ranks, num_microbatches=num_microbatches)
    return row.build(num_ranks=num_ranks, num_microbatches=num_microbatches, num_virtual=virtual)
