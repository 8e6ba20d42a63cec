"""Which spawned cases the default suite runs: 4- and 8-rank cases are ``slow``.

The default suite (``python3 -m pytest -q``, the README's test command) stays under 15 minutes on the
2-core machine by judging every strategy on 1 and 2 ranks; ``python3 -m pytest -q -m slow`` runs the
4-rank groups (dp=4, pp=2 x tp=2, dp=2 x pp=2, tp=4, ep x tp, ...) of the equivalence, data-parallel,
tensor-parallel, schedule, asynchronous, recompute, memory, precision, family, MoE, Hugging Face weight
and meta-built matrices, tests/shared_groups.py's 4-rank checkpoint group (and the 2-rank loads of
its checkpoints), and the 8-rank 3-D cases; ``.ci/run`` runs both, so CI judges every case.
"""
from __future__ import annotations

import pytest

__all__ = ["SLOW_WORLDS", "by_world"]

SLOW_WORLDS = (4,)


def by_world(items, world_of=lambda item: item.world_size, ids=None, slow_worlds=SLOW_WORLDS) -> list:
    """``items`` as pytest params, those of a world in ``slow_worlds`` marked ``slow``."""
    return [pytest.param(item, id=None if ids is None else ids(item),
                         marks=[pytest.mark.slow] if world_of(item) in slow_worlds else [])
            for item in items]
