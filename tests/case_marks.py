"""Which spawned cases the default suite runs: the 4-rank ones of the family and MoE matrices and the
8-rank ones of the equivalence and data-parallel matrices (3-D: dp=2 x pp=2 x tp=2) are ``slow``.

The default suite (``python3 -m pytest -q``, the README's test command) stays under 15 minutes on the
2-core machine; ``python3 -m pytest -q -m slow`` runs the 4-rank groups of the tensor-parallel family
matrices (tp=4, pp=2 x tp=2) and of expert parallelism (dp=4, ep x tp, checkpoints of split experts)
and the 8-rank 3-D cases, and ``.ci/run`` runs both, so CI judges every case.
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
