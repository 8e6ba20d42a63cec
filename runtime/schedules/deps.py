"""The dependency rule shared by the validator, the simulator and the executor.

Stages form one chain ``0 .. num_stages - 1`` in the model's layer order:

- ``F(s, i)`` needs ``F(s-1, i)`` (stage 0 needs nothing);
- ``B(s, i)`` needs ``F(s, i)`` and ``B(s+1, i)`` (the last stage needs only its forward);
- ``W(s, i)`` needs ``B(s, i)``.

A dependency on another rank costs one p2p transfer; one on the same rank costs nothing.

    >>> from autopar.runtime.schedules.action import Action
    >>> [str(a) for a in dependencies(Action.parse("1B3"), num_stages=4)]
    ['1F3', '2B3']
"""
from __future__ import annotations

from autopar.runtime.schedules.action import Action, ActionKind

__all__ = ["dependencies"]


def dependencies(action: Action, *, num_stages: int) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` may start."""
    stage, mb = action.stage, action.microbatch
    if action.kind is ActionKind.F:
        return (Action(stage - 1, ActionKind.F, mb),) if stage > 0 else ()
    if action.kind is ActionKind.B:
        own = Action(stage, ActionKind.F, mb)
        if stage + 1 < num_stages:
            return (own, Action(stage + 1, ActionKind.B, mb))
        return (own,)
    return (Action(stage, ActionKind.B, mb),)
