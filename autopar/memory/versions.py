"""Weight-sized buffers of the asynchronous schedules: what a stage holds besides its live weights.

An asynchronous pipeline (runtime/execution/async_pipeline.py) never drains, and between any two actions a
stage may hold, each the size of its trainable weights:

- a copy of each weight version that a forward in flight read while an update came before its
  backward (weight stashing: PipeDream, 2BW; a forward whose backward comes before any update reads
  the live weights themselves);
- the gradient of each update some backward has begun and that is not applied yet (updates are
  applied when a newer version is first read);
- PipeMare's velocity ``delta`` (PipeMare stashes nothing: its backward recomputes on the live weights).

:func:`weight_buffers` counts the most of them at once on each rank by walking the rank's actions of
a stream long enough to reach its steady state (:func:`steady_stream`); the staleness rule says
which version each action reads. The synchronous schedules hold none (their gradients are the
calculator's ``grads``).

    >>> from autopar.runtime.schedules import build_schedule
    >>> weight_buffers(steady_stream(build_schedule("pipedream", num_ranks=4, num_microbatches=4)))
    (4, 3, 2, 1)
    >>> weight_buffers(steady_stream(build_schedule("pipemare", num_ranks=4, num_microbatches=4)))
    (2, 2, 2, 2)
"""
from __future__ import annotations

from collections.abc import Sequence

from autopar.runtime.schedules.action import Action, ActionKind, Schedule
from autopar.runtime.schedules.registry import family

__all__ = ["steady_stream", "weight_buffers"]


def steady_stream(schedule: Schedule) -> Schedule:
    """The asynchronous ``schedule``'s stream of enough batches for every rank to reach its steady state
    (the pipeline's depth in microbatches, and two batches for 2BW's one-batch-late reads, after the fill)."""
    if schedule.staleness is None:
        return schedule
    p, m = schedule.num_ranks, schedule.num_microbatches
    return family(schedule.name).build(num_ranks=p, num_microbatches=m, num_batches=3 + -(-2 * p // m))


def weight_buffers(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most weight-sized buffers held between actions (0 for a synchronous ``schedule``)."""
    return tuple(_rank_buffers(row, schedule.staleness) for row in schedule.actions)


def _rank_buffers(row: Sequence[Action], rule) -> int:
    if rule is None:
        return 0
    reads = [_read(a, rule) for a in row]
    position = {(a.kind, a.microbatch): k for k, a in enumerate(row)}
    copies: dict[int, int] = {}  # microbatch in flight -> the version its forward copied
    begun: set[int] = set()  # updates with a gradient begun, not applied
    applied, peak = 0, 0
    for k, action in enumerate(row):
        version = reads[k]
        if version is not None and version > applied:
            begun -= set(range(applied, version))
            applied = version
        if action.kind is ActionKind.F and rule.stashes:
            back = position[(ActionKind.B, action.microbatch)]
            if any(v is not None and v > version for v in reads[k + 1:back]):  # an update comes first
                copies[action.microbatch] = version
        elif action.kind is ActionKind.B:
            copies.pop(action.microbatch, None)
            begun.add(rule.update_of(action.microbatch))
        peak = max(peak, len(set(copies.values())) + len(begun) + (0 if rule.stashes else 1))
    return peak


def _read(action: Action, rule) -> int | None:
    """The weight version ``action`` reads first (a stashing backward reads its forward's copy: None)."""
    if action.kind is ActionKind.F:
        return rule.forward_version(action.stage, action.microbatch)
    return None if rule.stashes else rule.backward_version(action.stage, action.microbatch)
