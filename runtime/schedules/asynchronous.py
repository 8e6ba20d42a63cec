"""Asynchronous schedules: PipeDream, PipeDream-2BW and PipeMare. 1F1B order, no flush.

Each stage updates its weights on its own clock, so the pipeline never drains between updates:
in a long stream the bubble is only the one fill at the start and the one drain at the end. What
each step reads is the schedule's :class:`~autopar.runtime.schedules.staleness.StalenessRule`
(``schedule.staleness``); the order is 1F1B's over the whole stream (rank ``r`` runs
``p - 1 - r`` warmup forwards, then alternates), which is exactly the order the rules assume.

- :func:`pipedream` (Narayanan et al. 2019): an update after every microbatch; weight stashing,
  so a backward reads the version its forward read. Stage ``s`` keeps up to ``p - s`` versions.
- :func:`pipedream_2bw` (Narayanan et al. 2021): gradients accumulated over ``m`` microbatches,
  one update per batch, applied one batch late: batch ``t`` reads version ``t - 1``, so
  ``W(t+1) = W(t) - lr * grad(W(t-1))``. Two versions per stage. Needs ``m >= p``.
- :func:`pipemare` (Yang et al. 2021): an update after every microbatch, no stashing (one
  version); learning rate rescheduled by each stage's delay and the backward's weights corrected.

The generators take the stream's length in batches of ``num_microbatches`` and end with the
drain. The runtime runs the same order without ever draining: each ``train_step`` runs the
:func:`stream_segment` that takes one more batch in (every forward of its microbatches, and the
backwards the 1F1B order puts between them), and ``flush()`` runs the drain.

    >>> s = pipedream(num_ranks=2, num_microbatches=3)
    >>> print(s.to_csv(), end="")
    0F0,0F1,0B0,0F2,0B1,0B2
    1F0,1B0,1F1,1B1,1F2,1B2
    >>> s.staleness.forward_version(0, 2)
    1
"""
from __future__ import annotations

import dataclasses

from autopar.errors import ScheduleError
from autopar.runtime.schedules._common import B, F, check_count, one_stage_per_rank
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.one_f_one_b import _rank_actions
from autopar.runtime.schedules.staleness import StalenessRule

__all__ = ["pipedream", "pipedream_2bw", "pipemare", "stream_segment"]


def _stream(name: str, p: int, total: int, rule: StalenessRule) -> Schedule:
    """1F1B over ``total`` microbatches (any count, fewer than ``p`` included), with ``rule`` attached."""
    schedule = one_stage_per_rank(name, num_ranks=p, num_microbatches=total,
                                  actions=[_rank_actions(r, p, total) for r in range(p)])
    return dataclasses.replace(schedule, staleness=rule)


def pipedream(*, num_ranks: int, num_microbatches: int, num_batches: int = 1) -> Schedule:
    """PipeDream: 1F1B without flush, an update per microbatch, weight stashing."""
    p = check_count("pipedream", "num_ranks", num_ranks)
    m = check_count("pipedream", "num_microbatches", num_microbatches)
    k = check_count("pipedream", "num_batches", num_batches)
    return _stream("pipedream", p, m * k, StalenessRule(kind="pipedream", num_stages=p))


def pipedream_2bw(*, num_ranks: int, num_microbatches: int, num_batches: int = 1) -> Schedule:
    """PipeDream-2BW: one update per batch of ``num_microbatches``, read one batch late."""
    p = check_count("pipedream_2bw", "num_ranks", num_ranks)
    m = check_count("pipedream_2bw", "num_microbatches", num_microbatches)
    k = check_count("pipedream_2bw", "num_batches", num_batches)
    if m < p:
        raise ScheduleError(
            f"pipedream_2bw needs num_microbatches >= {p} (a batch must outlast the pipeline for two weight "
            f"buffers to suffice), got {m}",
            where="schedule 'pipedream_2bw'", fix=f"raise num_microbatches to {p} or more, or use 'pipedream'")
    return _stream("pipedream_2bw", p, m * k, StalenessRule(kind="2bw", num_stages=p, updates_every=m))


def pipemare(*, num_ranks: int, num_microbatches: int, num_batches: int = 1, lr_warmup_updates: int = 100,
             correction_decay: float = 0.5) -> Schedule:
    """PipeMare: an update per microbatch, no stashing, learning-rate rescheduling and discrepancy correction."""
    p = check_count("pipemare", "num_ranks", num_ranks)
    m = check_count("pipemare", "num_microbatches", num_microbatches)
    k = check_count("pipemare", "num_batches", num_batches)
    rule = StalenessRule(kind="pipemare", num_stages=p, lr_warmup_updates=lr_warmup_updates,
                         correction_decay=correction_decay)
    return _stream("pipemare", p, m * k, rule)


def stream_segment(*, rank: int, num_ranks: int, next_forward: int, next_backward: int, end: int):
    """Rank ``rank``'s next actions of the endless 1F1B stream, up to the forward of microbatch ``end``.

    The rank keeps ``p - 1 - rank`` microbatches in flight: after each forward beyond that it runs
    the oldest pending backward. ``end=None`` means the drain: every pending backward. Returns the
    actions (stage ``rank``, global microbatch numbers) and the new ``(next_forward, next_backward)``.

        >>> [str(a) for a in stream_segment(rank=0, num_ranks=2, next_forward=0, next_backward=0, end=1)[0]]
        ['0F0', '0F1', '0B0']
    """
    warmup = num_ranks - 1 - rank
    actions = []
    if end is None:
        actions = [B(rank, i) for i in range(next_backward, next_forward)]
        return actions, (next_forward, next_forward)
    while next_forward <= end:
        actions.append(F(rank, next_forward))
        next_forward += 1
        if next_forward - next_backward > warmup:
            actions.append(B(rank, next_backward))
            next_backward += 1
    return actions, (next_forward, next_backward)
