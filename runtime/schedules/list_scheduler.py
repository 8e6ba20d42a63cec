"""Greedy list scheduling: turn a placement of stages on ranks into per-rank action orders.

Used by generators whose order is easiest to state as a rule rather than as a formula (Chimera).
Time advances event by event under fixed per-kind costs and free transfers; whenever a rank is
free, it starts the ready action with the best priority: a backward before a forward (so
activations are released early, as 1F1B does), then the lowest microbatch, then the lowest stage.
A forward on stage ``s`` may start only while fewer than ``cap(s)`` microbatches hold
activations there. The result is deadlock free by construction; the validator checks it anyway.

    >>> rows = list_schedule(num_ranks=2, stage_to_rank=(0, 1), chains=[(0, 1)] * 2,
    ...                      cap=lambda stage: 2 - stage)
    >>> [" ".join(str(a) for a in row) for row in rows]
    ['0F0 0F1 0B0 0B1', '1F0 1B0 1F1 1B1']
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Action, ActionKind

__all__ = ["list_schedule"]

_PRIORITY = {ActionKind.B: 0, ActionKind.F: 1}


def _actions_and_deps(chains: Sequence[Sequence[int]]) -> dict[Action, tuple[Action, ...]]:
    """Every F and B of each microbatch's chain, with what each waits on."""
    deps: dict[Action, tuple[Action, ...]] = {}
    for mb, chain in enumerate(chains):
        for k, stage in enumerate(chain):
            deps[Action(stage, ActionKind.F, mb)] = (Action(chain[k - 1], ActionKind.F, mb),) if k else ()
            after = (Action(chain[k + 1], ActionKind.B, mb),) if k + 1 < len(chain) else ()
            deps[Action(stage, ActionKind.B, mb)] = (Action(stage, ActionKind.F, mb),) + after
    return deps


def list_schedule(*, num_ranks: int, stage_to_rank: Sequence[int], chains: Sequence[Sequence[int]],
                  cap: Callable[[int], int], forward_cost: float = 1.0,
                  backward_cost: float = 2.0) -> list[list[Action]]:
    """Per-rank orders for microbatch ``i`` running through stages ``chains[i]``; see the module doc."""
    deps = _actions_and_deps(chains)
    pending = [sorted((a for a in deps if stage_to_rank[a.stage] == r),
                      key=lambda a: (_PRIORITY[a.kind], a.microbatch, a.stage)) for r in range(num_ranks)]
    end: dict[Action, float] = {}
    free = [0.0] * num_ranks
    held = [0] * len(stage_to_rank)
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    while any(pending):
        best = None
        for rank in range(num_ranks):
            ready = [a for a in pending[rank] if all(d in end for d in deps[a])
                     and (a.kind is ActionKind.B or held[a.stage] < cap(a.stage))]
            if not ready:
                continue
            start = max(free[rank], min(max((end[d] for d in deps[a]), default=0.0) for a in ready))
            if best is None or start < best[0]:
                due = [a for a in ready if max((end[d] for d in deps[a]), default=0.0) <= start]
                best = (start, rank, due[0])  # pending is kept in priority order
        if best is None:
            raise ScheduleError("list scheduling is stuck: every rank waits on a capped stage",
                                fix="raise the per-stage cap")
        start, rank, action = best
        pending[rank].remove(action)
        held[action.stage] += 1 if action.kind is ActionKind.F else -1
        cost = forward_cost if action.kind is ActionKind.F else backward_cost
        end[action] = free[rank] = start + cost
        rows[rank].append(action)
    return rows
