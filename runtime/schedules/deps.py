"""The dependency rule shared by the validator, the simulator and the schedule generators.

Stages form one chain ``0 .. num_stages - 1`` in the model's layer order:

- ``F(s, i)`` needs ``F(s-1, i)`` (stage 0 needs nothing);
- ``B(s, i)`` needs ``F(s, i)`` and ``B(s+1, i)`` (the last stage needs only its forward);
- ``W(s, i)`` needs ``B(s, i)``.

With ``num_replicas`` model replicas (Chimera) there are that many chains of
``num_stages // num_replicas`` stages each, and "first" and "last" refer to a stage's own chain.
A dependency on another rank costs one p2p transfer; one on the same rank costs nothing.

    >>> from autopar.runtime.schedules.action import Action
    >>> [str(a) for a in dependencies(Action.parse("1B3"), num_stages=4)]
    ['1F3', '2B3']
    >>> [str(a) for a in dependencies(Action.parse("2F0"), num_stages=4, num_replicas=2)]  # stage 2 starts replica 1
    []
"""
from __future__ import annotations

from autopar.runtime.schedules.action import Action, ActionKind, Schedule

__all__ = ["dependencies", "needs", "step_needs"]


def dependencies(action: Action, *, num_stages: int, num_replicas: int = 1) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` may start."""
    stage, mb = action.stage, action.microbatch
    parts = num_stages // num_replicas
    first, last = stage % parts == 0, stage % parts == parts - 1
    if action.kind is ActionKind.F:
        return () if first else (Action(stage - 1, ActionKind.F, mb),)
    if action.kind is ActionKind.B:
        own = Action(stage, ActionKind.F, mb)
        return (own,) if last else (own, Action(stage + 1, ActionKind.B, mb))
    return (Action(stage, ActionKind.B, mb),)


def needs(schedule: Schedule) -> tuple[tuple[tuple[Action, ...], ...], ...]:
    """Per rank and step of ``schedule``, the actions that step waits for, computed once per schedule (kept in
    its ``memo``): the validator and the simulators read them for every action, and the planner simulates one
    schedule under many costs."""
    if "needs" not in schedule.memo:
        schedule.memo["needs"] = tuple(
            tuple(dependencies(a, num_stages=schedule.num_stages, num_replicas=schedule.num_replicas) for a in row)
            for row in schedule.actions)
    return schedule.memo["needs"]


def step_needs(schedule: Schedule) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """:func:`needs` by step number: (the first step number of each rank, per step the step numbers it waits
    for), where rank ``r``'s step ``i`` is number ``first[r] + i`` (a simulator indexes lists by them)."""
    if "step_needs" not in schedule.memo:
        first, total = [], 0
        for row in schedule.actions:
            first.append(total)
            total += len(row)
        number = {a: first[r] + i for r, row in enumerate(schedule.actions) for i, a in enumerate(row)}
        schedule.memo["step_needs"] = (tuple(first),
                                       tuple(tuple(number[d] for d in deps) for row in needs(schedule) for deps in row))
    return schedule.memo["step_needs"]
