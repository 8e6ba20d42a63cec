"""Step time, bubble and activation memory of a :class:`Schedule` from per-stage costs, without running it.

The simulation is event-driven: each rank runs its list in order, and an action starts at
``max(time the rank is free, end of each dependency + p2p if that dependency ran on another rank)``.
Dependencies follow :mod:`autopar.runtime.schedules.deps`.

    >>> from autopar.runtime.schedules.gpipe import gpipe
    >>> result = simulate(gpipe(num_ranks=4, num_microbatches=8), costs=StageCosts(forward=1, backward=1, weight=0))
    >>> round(result.mean_bubble, 6) == round(3 / 11, 6)   # (p - 1) / (m + p - 1)
    True
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Union

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Action, ActionKind, Schedule
from autopar.runtime.schedules.deps import step_needs
from autopar.runtime.schedules.step_graph import CriticalPath, critical_path
from autopar.runtime.schedules.validator import validate

__all__ = ["StageCosts", "Event", "SimResult", "simulate"]

Cost = Union[float, Sequence[float]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Time of one microbatch's forward, input-gradient backward and weight-gradient on each stage.

    Each of ``forward``, ``backward`` and ``weight`` is one number for every stage or a sequence with
    one number per stage. When a schedule does not split backward, its B costs ``backward + weight``
    (the full backward); when it does, B costs ``backward`` and W costs ``weight``. ``p2p`` is added
    to every dependency that crosses ranks.
    """

    forward: Cost
    backward: Cost
    weight: Cost
    p2p: float = 0.0

    def __post_init__(self) -> None:
        for field in ("forward", "backward", "weight"):
            value = getattr(self, field)
            values = (value,) if isinstance(value, (int, float)) else tuple(value)
            if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in values):
                raise ScheduleError(f"StageCosts.{field} must be a number >= 0 or a sequence of them, got {value!r}")
            if not isinstance(value, (int, float)):
                object.__setattr__(self, field, values)
        if self.p2p < 0:
            raise ScheduleError(f"StageCosts.p2p must be >= 0, got {self.p2p!r}")

    def _of(self, field: str, stage: int, num_stages: int) -> float:
        value = getattr(self, field)
        if isinstance(value, (int, float)):
            return float(value)
        if len(value) != num_stages:
            raise ScheduleError(
                f"StageCosts.{field} has {len(value)} entries for {num_stages} stages",
                fix="give one cost per stage or a single number for all stages",
            )
        return float(value[stage])

    def cost(self, action: Action, *, num_stages: int, split_backward: bool) -> float:
        """How long ``action`` takes."""
        if action.kind is ActionKind.F:
            return self._of("forward", action.stage, num_stages)
        if action.kind is ActionKind.W:
            return self._of("weight", action.stage, num_stages)
        backward = self._of("backward", action.stage, num_stages)
        return backward if split_backward else backward + self._of("weight", action.stage, num_stages)


class Event(NamedTuple):
    """One simulated action: what ran, and when."""

    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured, per rank where a field is a tuple.

    ``step_time``: when the last action ends (all ranks start at 0).
    ``per_rank_busy``: summed action time of each rank.
    ``bubble_fraction``: ``1 - busy / step_time`` of each rank; ``mean_bubble`` is their mean.
    ``peak_activations``: per rank, the most (stage, microbatch) pairs whose F has run and whose
    releasing action has not (B when backward is not split, W when it is), counted right after each
    F. The unit is one microbatch's activations of one stage: a rank running ``v`` stages of a
    ``v``-times finer split counts each of them, so divide by ``v`` to compare with one-stage ranks.
    ``steady_step_time``: the time per step when steps run back to back with no flush between them
    (each rank starts its next step when its own list is done, as the zero-bubble paper's
    post-validated optimizer step allows), taken as the longest span from a rank's first action
    start to its last action end. That is exact when rank 0 has the longest span or every span
    equals its busy time (every generator here under uniform costs), and an upper bound otherwise.
    ``steady_bubble``: mean over ranks of ``1 - busy / steady_step_time``.
    ``events``: per rank, (action, start, end) in execution order.
    ``weight_versions``: the most weight versions any rank keeps at once; 1 for every synchronous
    schedule, more for the asynchronous ones that stash (``weight_versions_per_rank`` per rank).
    A forward-only schedule keeps no activations for backward: its ``peak_activations`` are 0.
    ``critical_path``: the actions and transfers that make ``step_time`` what it is, each with the
    time it contributes (:class:`~autopar.runtime.schedules.step_graph.CriticalPath`; its length is
    ``step_time``). It is the longest path of the step's dependency graph, evaluated by networkx on
    first use: the timing above is the same model of the step evaluated event by event, several
    times faster, which is what the planner's thousands of simulations use.
    """

    step_time: float
    per_rank_busy: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    mean_bubble: float
    peak_activations: tuple[int, ...]
    steady_step_time: float
    steady_bubble: float
    events: tuple[tuple[Event, ...], ...]
    weight_versions: int = 1
    weight_versions_per_rank: tuple[int, ...] = ()
    schedule: Schedule | None = dataclasses.field(default=None, repr=False, compare=False)
    costs: StageCosts | None = dataclasses.field(default=None, repr=False, compare=False)
    durations: Mapping[Action, float] | None = dataclasses.field(default=None, repr=False, compare=False)

    @functools.cached_property
    def critical_path(self) -> CriticalPath:
        """The step's longest path (computed once, on first use)."""
        return critical_path(self.schedule, costs=self.costs, durations=self.durations)


def simulate(schedule: Schedule, *, costs: StageCosts, durations: Mapping[Action, float] | None = None,
             validated: bool = False) -> SimResult:
    """Validate ``schedule``, then time it under ``costs``.

    ``durations`` overrides the cost of individual actions (a replay of measured times, as
    :func:`autopar.runtime.execution.trace.replay` does); ``costs.p2p`` still applies. ``validated``: the caller
    has validated this very schedule already (the planner simulates one cached schedule under many costs).
    """
    if not validated:
        validate(schedule)
    events = _run(schedule, costs, durations or {})
    step_time = max((row[-1].end for row in events if row), default=0.0)
    busy = tuple(sum(e.end - e.start for e in row) for row in events)
    bubble = _bubbles(busy, step_time)
    steady_step_time = max((row[-1].end - row[0].start for row in events if row), default=0.0)
    versions = tuple(_weight_versions(row, schedule.staleness) for row in schedule.actions)
    return SimResult(
        step_time=step_time,
        per_rank_busy=busy,
        bubble_fraction=bubble,
        mean_bubble=sum(bubble) / len(bubble),
        steady_step_time=steady_step_time,
        steady_bubble=sum(_bubbles(busy, steady_step_time)) / len(busy),
        peak_activations=tuple(0 if schedule.forward_only else _peak_activations(row, schedule.split_backward)
                               for row in schedule.actions),
        events=events,
        weight_versions=max(versions, default=1),
        weight_versions_per_rank=versions,
        schedule=schedule,
        costs=costs,
        durations=durations,
    )


def _bubbles(busy: Sequence[float], step_time: float) -> tuple[float, ...]:
    """Idle share of ``step_time`` for each rank's ``busy`` time."""
    return tuple(1.0 - b / step_time if step_time > 0 else 0.0 for b in busy)


def _run(schedule: Schedule, costs: StageCosts, durations: Mapping[Action, float]) -> tuple[tuple[Event, ...], ...]:
    """Event-driven timing of a validated schedule (its steps by number: deps.step_needs)."""
    first, needs = step_needs(schedule)
    p2p = costs.p2p
    cost_of = {kind: [costs.cost(Action(s, kind, 0), num_stages=schedule.num_stages,
                                 split_backward=schedule.split_backward) for s in range(schedule.num_stages)]
               for kind in ActionKind}
    rank_of = [r for r, row in enumerate(schedule.actions) for _ in row]
    end: list[float | None] = [None] * len(rank_of)
    free = [0.0] * schedule.num_ranks
    timeline: list[list[Event]] = [[] for _ in range(schedule.num_ranks)]
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(schedule.actions):
            events, base = timeline[rank], first[rank]
            done = len(events)
            while done < len(row):
                deps = needs[base + done]
                start = free[rank]
                for d in deps:
                    if end[d] is None:
                        break
                    ready = end[d] + (p2p if rank_of[d] != rank else 0.0)
                    if ready > start:
                        start = ready
                else:
                    action = row[done]
                    cost = durations.get(action) if durations else None
                    if cost is None:
                        cost = cost_of[action.kind][action.stage]
                    free[rank] = end[base + done] = start + cost
                    events.append(Event(action, start, free[rank]))
                    done += 1
                    progress = True
                    continue
                break
    return tuple(tuple(row) for row in timeline)


def _peak_activations(row: Sequence[Action], split_backward: bool) -> int:
    """Most (stage, microbatch) activations held at once by a rank running ``row`` in order."""
    release = ActionKind.W if split_backward else ActionKind.B
    held = peak = 0
    for action in row:
        if action.kind is ActionKind.F:
            held += 1
            peak = max(peak, held)
        elif action.kind is release:
            held -= 1
    return peak


def _weight_versions(row: Sequence[Action], rule) -> int:
    """Most weight versions a rank running ``row`` keeps at once under staleness ``rule`` (None: 1)."""
    if rule is None:
        return 1
    in_flight: dict[int, int] = {}  # microbatch -> version its backward will read
    updates, peak = 0, 1
    for action in row:
        if action.kind is ActionKind.F and rule.stashes:
            in_flight[action.microbatch] = rule.backward_version(action.stage, action.microbatch)
        elif action.kind is ActionKind.B:
            in_flight.pop(action.microbatch, None)
            updates += rule.closes_update(action.microbatch)
        peak = max(peak, len(set(in_flight.values()) | {updates}))
    return peak
