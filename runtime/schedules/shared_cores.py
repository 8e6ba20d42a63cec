"""A schedule's step time when its ranks share fewer cores than there are ranks (CPU processes).

:func:`autopar.runtime.schedules.simulator.simulate` gives every rank a device of its own. Gloo
ranks on a CPU machine are processes that share its cores: while ``n`` ranks have work and there
are ``c < n`` cores, each runs at ``c / n`` of its lone speed (the operating system shares the
cores fairly), and a rank waiting for a transfer runs nothing, so its core goes to the others:
a pipeline's bubble then costs little. (What each switch between ranks costs, their caches
refilled, the caller adds to the actions' costs: :mod:`autopar.planner.cost_model`.)

The simulation is event-driven like :func:`~autopar.runtime.schedules.simulator.simulate`: each
rank runs its list in order; an action becomes ready at the end of its dependencies (plus
``costs.p2p`` across ranks); the ready actions share the cores (processor sharing). Costs are
lone-rank seconds; ``cores`` may be fractional (a pipeline whose node also runs other replicas).

    >>> from autopar.runtime.schedules import StageCosts, build_schedule
    >>> s = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    >>> costs = StageCosts(forward=1, backward=2, weight=0)
    >>> simulate_shared_cores(s, costs=costs, cores=4)   # a core each: the plain simulator's 33.0
    33.0
    >>> simulate_shared_cores(s, costs=costs, cores=2)   # 96 s of work on 2 cores: 48 s, plus fill and drain
    51.0
"""
from __future__ import annotations

from autopar.errors import ScheduleError
from autopar.runtime.schedules.action import Action, Schedule
from autopar.runtime.schedules.deps import needs
from autopar.runtime.schedules.simulator import StageCosts
from autopar.runtime.schedules.validator import validate

__all__ = ["simulate_shared_cores"]

_EPS = 1e-12


def simulate_shared_cores(schedule: Schedule, *, costs: StageCosts, cores: float, validated: bool = False) -> float:
    """Step time of ``schedule`` with its ranks on ``cores`` shared cores (costs: lone-rank seconds).

    ``validated``: the caller has validated this very schedule already (as :func:`simulate` takes it)."""
    if not cores > 0:
        raise ScheduleError(f"cores must be > 0, got {cores}")
    if not validated:
        validate(schedule)
    rows, owner = schedule.actions, schedule.stage_to_rank
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    end: dict[Action, float] = {}
    pos = [0] * num_ranks
    free = [0.0] * num_ranks  # when each rank finished its previous action
    ready: list[float | None] = [None] * num_ranks  # when the next action may start (None: deps not done)
    left = [0.0] * num_ranks  # lone-rank seconds left of the running action
    running = [False] * num_ranks
    now = 0.0

    def arm(rank: int) -> None:
        """Set when rank's next action may start, once all its dependencies have ended."""
        if pos[rank] >= len(rows[rank]) or running[rank] or ready[rank] is not None:
            return
        deps = needs(schedule)[rank][pos[rank]]
        if not all(d in end for d in deps):
            return
        arrival = max((end[d] + (costs.p2p if owner[d.stage] != rank else 0.0) for d in deps), default=0.0)
        ready[rank] = max(free[rank], arrival)

    for rank in range(num_ranks):
        arm(rank)
    while True:
        for rank in range(num_ranks):  # start what is ready now
            if ready[rank] is not None and ready[rank] <= now + _EPS:
                action = rows[rank][pos[rank]]
                left[rank] = costs.cost(action, num_stages=num_stages, split_backward=schedule.split_backward)
                running[rank], ready[rank] = True, None
        active = [r for r in range(num_ranks) if running[r]]
        pending = [ready[r] for r in range(num_ranks) if ready[r] is not None]
        if not active and not pending:
            break
        speed = min(1.0, cores / len(active)) if active else 1.0
        step = min([left[r] / speed for r in active] + [t - now for t in pending])
        step = max(step, 0.0)
        now += step
        for rank in active:
            left[rank] -= step * speed
            if left[rank] <= _EPS:
                end[rows[rank][pos[rank]]] = free[rank] = now
                running[rank] = False
                pos[rank] += 1
        for rank in range(num_ranks):
            arm(rank)
    if any(pos[r] < len(rows[r]) for r in range(num_ranks)):  # validated schedules cannot stall
        raise ScheduleError("the shared-core simulation stalled", where=f"schedule {schedule.name!r}")
    return now
