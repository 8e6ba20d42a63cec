"""1F1B, also called PipeDream-Flush (Narayanan et al. 2021).

Rank ``r`` runs stage ``r``: ``p - 1 - r`` warmup forwards, then alternating one forward and one
backward, then the remaining backwards. Same bubble as GPipe, ``(p - 1) / (m + p - 1)``, but rank
``r`` holds at most ``p - r`` microbatches' activations instead of ``m``.

Like torch.distributed.pipelining's Schedule1F1B, it needs ``num_microbatches >= num_ranks``.

    >>> print(one_f_one_b(num_ranks=2, num_microbatches=3).to_csv(), end="")
    0F0,0F1,0B0,0F2,0B1,0B2
    1F0,1B0,1F1,1B1,1F2,1B2
"""
from __future__ import annotations

from autopar.runtime.schedules._common import B, F, check_count, one_stage_per_rank, require_min_microbatches
from autopar.runtime.schedules.action import Action, Schedule

__all__ = ["one_f_one_b"]


def one_f_one_b(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Warmup forwards, steady one-forward-one-backward, cooldown backwards."""
    p = check_count("1f1b", "num_ranks", num_ranks)
    m = check_count("1f1b", "num_microbatches", num_microbatches)
    require_min_microbatches("1f1b", num_microbatches=m, minimum=p,
                             why="one microbatch in flight per stage, as torch's Schedule1F1B requires")
    return one_stage_per_rank("1f1b", num_ranks=p, num_microbatches=m,
                              actions=[_rank_actions(r, p, m) for r in range(p)])


def _rank_actions(rank: int, p: int, m: int) -> list[Action]:
    """Rank ``rank``'s 1F1B order."""
    warmup = min(p - 1 - rank, m)
    row = [F(rank, i) for i in range(warmup)]
    for k in range(m - warmup):
        row += [F(rank, warmup + k), B(rank, k)]
    row += [B(rank, i) for i in range(m - warmup, m)]
    return row
