"""GPipe (Huang et al. 2019): every forward, then every backward.

Rank ``r`` runs stage ``r``; backwards go in microbatch order, as torch.distributed.pipelining's
ScheduleGPipe does. Bubble ``(p - 1) / (m + p - 1)``; each rank holds all ``m`` microbatches'
activations at the turn.

    >>> print(gpipe(num_ranks=2, num_microbatches=2).to_csv(), end="")
    0F0,0F1,0B0,0B1
    1F0,1F1,1B0,1B1
"""
from __future__ import annotations

from autopar.runtime.schedules._common import B, F, check_count, one_stage_per_rank
from autopar.runtime.schedules.action import Schedule

__all__ = ["gpipe"]


def gpipe(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards in microbatch order, then all backwards in microbatch order, on every rank."""
    p = check_count("gpipe", "num_ranks", num_ranks)
    m = check_count("gpipe", "num_microbatches", num_microbatches)
    rows = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return one_stage_per_rank("gpipe", num_ranks=p, num_microbatches=m, actions=rows)
