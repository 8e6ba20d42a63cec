"""Schedules with several stages per rank: interleaved 1F1B and looped breadth-first.

The model is cut into ``p * v`` stages; stage ``s`` runs on rank ``s % p``, so rank ``r`` runs
stages ``r, r + p, ..., r + (v - 1) p`` (its "local stages" or model chunks).

- :func:`interleaved_1f1b` is Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2):
  depth-first, one forward and one backward in steady state. Bubble ``(p - 1) / (v m + p - 1)``.
- :func:`looped_bfs` is breadth-first pipelining (Lamy-Poirier 2023): each rank runs every
  microbatch of its first local stage, then of the next; backwards go through the local stages in
  reverse, microbatches in reverse, like torch.distributed.pipelining's ScheduleLoopedBFS.
"""
from __future__ import annotations

from autopar.errors import ScheduleError
from autopar.runtime.schedules._common import B, F, check_count
from autopar.runtime.schedules.action import Action, Schedule

__all__ = ["interleaved_1f1b", "looped_bfs"]


def _looped(name: str, p: int, m: int, v: int, rows: list[list[Action]]) -> Schedule:
    """A Schedule with stage ``s`` on rank ``s % p``."""
    return Schedule(
        name=name, num_ranks=p, num_stages=p * v, num_microbatches=m,
        stage_to_rank=tuple(s % p for s in range(p * v)), actions=tuple(tuple(r) for r in rows),
    )


def interleaved_1f1b(*, num_ranks: int, num_microbatches: int, num_virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B with ``num_virtual`` stages per rank; needs ``m % p == 0``."""
    p = check_count("interleaved_1f1b", "num_ranks", num_ranks)
    m = check_count("interleaved_1f1b", "num_microbatches", num_microbatches)
    v = check_count("interleaved_1f1b", "num_virtual", num_virtual, minimum=2)
    if m % p:
        raise ScheduleError(
            f"interleaved_1f1b needs num_microbatches to be a multiple of num_ranks, got {m} and {p}",
            where="schedule 'interleaved_1f1b'",
            fix=f"use num_microbatches={(m // p + 1) * p} (or another multiple of {p})",
        )
    return _looped("interleaved_1f1b", p, m, v, [_interleaved_rank(r, p, m, v) for r in range(p)])


def _interleaved_rank(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Rank ``rank``'s order: Megatron's warmup, steady 1F1B and cooldown over ``m * v`` chunk-steps."""

    def step(k: int, *, forward: bool) -> Action:
        # Microbatches go in groups of p; each group passes every local stage before the next group.
        chunk = (k // p) % v
        stage = (chunk if forward else v - 1 - chunk) * p + rank
        microbatch = (k // (p * v)) * p + k % p
        return F(stage, microbatch) if forward else B(stage, microbatch)

    total = m * v
    warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
    row = [step(k, forward=True) for k in range(warmup)]
    for k in range(total - warmup):
        row += [step(warmup + k, forward=True), step(k, forward=False)]
    row += [step(k, forward=False) for k in range(total - warmup, total)]
    return row


def looped_bfs(*, num_ranks: int, num_microbatches: int, num_virtual: int) -> Schedule:
    """Breadth-first: all microbatches through each local stage in turn, then backwards in reverse."""
    p = check_count("looped_bfs", "num_ranks", num_ranks)
    m = check_count("looped_bfs", "num_microbatches", num_microbatches)
    v = check_count("looped_bfs", "num_virtual", num_virtual)
    rows = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        forwards = [F(s, i) for s in stages for i in range(m)]
        backwards = [B(s, i) for s in reversed(stages) for i in reversed(range(m))]
        rows.append(forwards + backwards)
    return _looped("looped_bfs", p, m, v, rows)
