"""Helpers shared by the schedule generators: argument checks and assembling a Schedule."""
from __future__ import annotations

from collections.abc import Sequence

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Action, ActionKind, Schedule

__all__ = ["check_count", "require_min_microbatches", "one_stage_per_rank", "F", "B", "W"]


def F(stage: int, microbatch: int) -> Action:
    """Forward of ``microbatch`` on ``stage``."""
    return Action(stage, ActionKind.F, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """Backward (full, or input-gradient when split) of ``microbatch`` on ``stage``."""
    return Action(stage, ActionKind.B, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """Weight gradient of ``microbatch`` on ``stage``."""
    return Action(stage, ActionKind.W, microbatch)


def check_count(schedule: str, name: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise a ScheduleError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleError(
            f"{name} must be an int >= {minimum}, got {value!r}",
            where=f"schedule {schedule!r}",
            fix=f"pass {name}={max(minimum, 1)} or more",
        )
    return value


def require_min_microbatches(schedule: str, *, num_microbatches: int, minimum: int, why: str) -> None:
    """Raise a ScheduleError unless there are at least ``minimum`` microbatches."""
    if num_microbatches < minimum:
        raise ScheduleError(
            f"{schedule} needs num_microbatches >= {minimum} ({why}), got {num_microbatches}",
            where=f"schedule {schedule!r}",
            fix=f"raise num_microbatches to {minimum} or more, or use the 'gpipe' schedule",
        )


def one_stage_per_rank(
    name: str, *, num_ranks: int, num_microbatches: int, actions: Sequence[Sequence[Action]],
    split_backward: bool = False,
) -> Schedule:
    """A Schedule whose stage ``r`` runs on rank ``r``."""
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(range(num_ranks)),
        actions=tuple(tuple(row) for row in actions),
        split_backward=split_backward,
    )
