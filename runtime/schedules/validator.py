"""Check a :class:`Schedule` before anything runs it.

:func:`validate` runs these checks in order and raises on the first that fails:

1. every action names a stage and microbatch of the schedule, a stage of the microbatch's replica
   (Chimera), W only when backward is split and F only when the schedule is ``forward_only``;
2. every action is on the rank that owns its stage;
3. every (stage, microbatch) of the microbatch's chain has exactly one F and one B, and one W iff
   ``split_backward`` (only the F of a ``forward_only`` schedule);
4. on each rank, an action comes after the same-rank actions it depends on;
5. no deadlock: executing the per-rank lists in order, each rank blocking on its next action until
   that action's dependencies are done, finishes every action. A schedule that stalls has a cycle in
   its step graph (:mod:`~autopar.runtime.schedules.step_graph`), and the error prints it: each action
   waiting for the next, by its rank's order or for its input, back to the first. (The check itself
   runs the lists, which is 5 to 15 times faster than building the graph: see docs/architecture.md.)

A failure raises :class:`~autopar.errors.ScheduleError` whose message prints the schedule with the bad
steps wrapped in ``[ ]`` and, for a deadlock, each blocked rank's next action and what it waits on, and
the cycle of actions (the cycle's actions are the ones marked).
"""
from __future__ import annotations

from collections.abc import Iterable

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Action, ActionKind, Schedule
from autopar.runtime.schedules.deps import needs
from autopar.runtime.schedules.step_graph import wait_cycle

__all__ = ["validate"]

Position = tuple[int, int]  # (rank, index in that rank's list)


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError, with the bad steps marked, unless ``schedule`` is complete, placed and runnable."""
    _check_ranges(schedule)
    _check_placement(schedule)
    _check_counts(schedule)
    _check_local_order(schedule)
    _check_deadlock(schedule)


def _fail(schedule: Schedule, problem: str, marks: Iterable[Position], details: list[str], fix: str) -> None:
    """Raise a ScheduleError that lists ``details`` and prints the schedule with ``marks`` bracketed."""
    shown = details[:20] + ([f"... and {len(details) - 20} more"] if len(details) > 20 else [])
    error = ScheduleError(
        f"schedule {schedule.name!r} {problem}:\n  " + "\n  ".join(shown),
        where="the steps marked [ ] in the schedule printed below",
        fix=fix,
    )
    error.args = (f"{error.args[0]}\n{schedule.format(marks=set(marks))}",)
    raise error


def _positions(schedule: Schedule) -> Iterable[tuple[Position, Action]]:
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            yield (rank, index), action


def _check_ranges(schedule: Schedule) -> None:
    bad, details = [], []
    for pos, a in _positions(schedule):
        if a.stage >= schedule.num_stages or a.microbatch >= schedule.num_microbatches:
            bad.append(pos)
            details.append(
                f"rank {pos[0]} step {pos[1]}: {a} is outside stages 0..{schedule.num_stages - 1} "
                f"or microbatches 0..{schedule.num_microbatches - 1}"
            )
        elif a.kind is ActionKind.W and not schedule.split_backward:
            bad.append(pos)
            details.append(f"rank {pos[0]} step {pos[1]}: {a} is a W in a schedule that does not split backward")
        elif a.kind is not ActionKind.F and schedule.forward_only:
            bad.append(pos)
            details.append(f"rank {pos[0]} step {pos[1]}: {a} is a {a.kind} in a forward-only schedule")
        elif a.stage not in schedule.chain(a.microbatch):
            bad.append(pos)
            details.append(f"rank {pos[0]} step {pos[1]}: {a} runs microbatch {a.microbatch} on stage {a.stage}, "
                           f"outside its replica's stages {list(schedule.chain(a.microbatch))}")
    if bad:
        _fail(schedule, "has actions that do not fit it", bad, details,
              "drop those actions, or fix num_stages / num_microbatches / split_backward")


def _check_placement(schedule: Schedule) -> None:
    bad, details = [], []
    for pos, a in _positions(schedule):
        owner = schedule.stage_to_rank[a.stage]
        if owner != pos[0]:
            bad.append(pos)
            details.append(f"rank {pos[0]} step {pos[1]}: {a} belongs to rank {owner}, which owns stage {a.stage}")
    if bad:
        _fail(schedule, "runs stages on ranks that do not own them", bad, details,
              "move each action to the rank in stage_to_rank, or fix stage_to_rank")


def _check_counts(schedule: Schedule) -> None:
    seen: dict[Action, Position] = {}
    bad, details = [], []
    for pos, a in _positions(schedule):
        if a in seen:
            bad.append(pos)
            details.append(f"rank {pos[0]} step {pos[1]}: {a} repeats rank {seen[a][0]} step {seen[a][1]}")
        else:
            seen[a] = pos
    kinds = (ActionKind.F, ActionKind.B) + ((ActionKind.W,) if schedule.split_backward else ())
    kinds = (ActionKind.F,) if schedule.forward_only else kinds
    for mb in range(schedule.num_microbatches):
        for stage in schedule.chain(mb):
            for kind in kinds:
                if Action(stage, kind, mb) not in seen:
                    details.append(f"{Action(stage, kind, mb)} is missing (it belongs on rank "
                                   f"{schedule.stage_to_rank[stage]})")
    if details:
        _fail(schedule, "does not run every action exactly once", bad, details,
              "give each (stage, microbatch) one F and one B, plus one W when split_backward (only the F "
              "when forward_only)")


def _check_local_order(schedule: Schedule) -> None:
    index_of = {a: pos for pos, a in _positions(schedule)}
    bad, details = [], []
    for pos, a in _positions(schedule):
        for dep in needs(schedule)[pos[0]][pos[1]]:
            dep_pos = index_of[dep]
            if dep_pos[0] == pos[0] and dep_pos[1] > pos[1]:
                bad.append(pos)
                details.append(f"rank {pos[0]} step {pos[1]}: {a} runs before {dep} (step {dep_pos[1]}), "
                               "which it needs")
    if bad:
        _fail(schedule, "orders actions before the same-rank actions they need", bad, details,
              "move each marked action after its dependency")


def _check_deadlock(schedule: Schedule) -> None:
    next_index = [0] * schedule.num_ranks
    done: set[Action] = set()
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(schedule.actions):
            while next_index[rank] < len(row) and all(d in done for d in needs(schedule)[rank][next_index[rank]]):
                done.add(row[next_index[rank]])
                next_index[rank] += 1
                progress = True
    blocked = [r for r, row in enumerate(schedule.actions) if next_index[r] < len(row)]
    if not blocked:
        return
    index_of = {a: pos for pos, a in _positions(schedule)}
    details = []
    for rank in blocked:
        action = schedule.actions[rank][next_index[rank]]
        for dep in needs(schedule)[rank][next_index[rank]]:
            if dep not in done:
                dep_rank, dep_index = index_of[dep]
                waiting_on = schedule.actions[dep_rank][next_index[dep_rank]]
                details.append(f"rank {rank} is blocked at {action} (step {next_index[rank]}) waiting on {dep} "
                               f"(rank {dep_rank} step {dep_index}, not reached: rank {dep_rank} is "
                               f"blocked at {waiting_on})")
    cycle = wait_cycle(schedule)
    assert cycle is not None, "a stalled schedule whose counts and order are intact has a cycle"
    cycle = _merge_same_rank(cycle, index_of)
    details.append("the cycle: " + _describe_cycle(cycle, index_of))
    marks = [index_of[a] for a, _dep, _why in cycle]
    _fail(schedule, "deadlocks", marks, details,
          "reorder the marked ranks so every dependency can be produced before it is awaited")


def _merge_same_rank(cycle: list[tuple[Action, Action, str]],
                     index_of: dict[Action, Position]) -> list[tuple[Action, Action, str]]:
    """The cycle with each run of waits inside one rank folded into one ``order`` wait (an earlier step).

    No run wraps round the cycle's start: :func:`wait_cycle` starts at the cycle's lowest (rank, step), and an
    action waits within its rank only for an earlier step (the order check has passed), which would be lower;
    so the first wait is for another rank's action.
    """
    merged: list[tuple[Action, Action, str]] = []
    for action, dep, why in cycle:
        if index_of[action][0] == index_of[dep][0]:
            why = "order"
            if merged and merged[-1][2] == "order" and index_of[merged[-1][0]][0] == index_of[action][0]:
                action = merged.pop()[0]
        merged.append((action, dep, why))
    return merged


def _describe_cycle(cycle: list[tuple[Action, Action, str]], index_of: dict[Action, Position]) -> str:
    """``0B0 (rank 0 step 1) waits for its input 1B0 (rank 1 step 3), which runs after 1F1 ...``: back to the start."""
    def at(a: Action) -> str:
        return f"{a} (rank {index_of[a][0]} step {index_of[a][1]})"

    words = [at(cycle[0][0])]
    for _action, dep, why in cycle:
        words.append(f"{'waits for its input' if why == 'data' else 'runs after'} {at(dep)}")
    return ", which ".join([" ".join(words[:2]), *words[2:]])
