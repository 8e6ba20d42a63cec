"""Naive model parallelism: one microbatch at a time goes forward through every stage, then back.

Rank ``r`` runs stage ``r``. No two ranks ever compute at once, so each rank idles ``1 - 1/p`` of
the step.

    >>> print(naive(num_ranks=2, num_microbatches=2).to_csv(), end="")
    0F0,0B0,0F1,0B1
    1F0,1B0,1F1,1B1
"""
from __future__ import annotations

from autopar.runtime.schedules._common import B, F, check_count, one_stage_per_rank
from autopar.runtime.schedules.action import Schedule

__all__ = ["naive"]


def naive(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Microbatches strictly one after another: F through all stages, then B back, then the next."""
    p = check_count("naive", "num_ranks", num_ranks)
    m = check_count("naive", "num_microbatches", num_microbatches)
    rows = [[a for i in range(m) for a in (F(r, i), B(r, i))] for r in range(p)]
    return one_stage_per_rank("naive", num_ranks=p, num_microbatches=m, actions=rows)
