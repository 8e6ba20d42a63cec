"""The closed form is a lower bound of the simulated step time (autopar/planner/pipeline_bound.py).

Every covered schedule family on a grid of small pipelines, with random per-stage costs, against
both simulators (a device per rank; ranks sharing cores). No processes, no timing.
"""
from __future__ import annotations

import itertools
import random

import pytest

from autopar.errors import ScheduleError
from autopar.planner.pipeline_bound import COVERED_SCHEDULES, pipeline_lower_bound, relaxed_bound
from autopar.runtime.schedules.registry import build_schedule
from autopar.runtime.schedules.shared_cores import simulate_shared_cores
from autopar.runtime.schedules.simulator import StageCosts, simulate

_VIRTUAL = {"interleaved_1f1b": (2, 3), "looped_bfs": (1, 2), "zb_v": (2,)}


def _schedules():
    for name in COVERED_SCHEDULES:
        for pp, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 6, 8)):
            for v in _VIRTUAL.get(name, (1,)):
                try:
                    yield build_schedule(name, num_ranks=pp, num_microbatches=m, num_virtual=v)
                except ScheduleError:
                    continue


SCHEDULES = list(_schedules())


def _costs(rng: random.Random, stages: int) -> StageCosts:
    skew = rng.choice((0.0, 1.0, 5.0))  # equal stages, mildly and strongly unequal ones
    draw = lambda: [rng.uniform(1.0, 1.0 + skew) * rng.choice((1.0, 1.0, 3.0)) for _ in range(stages)]  # noqa: E731
    return StageCosts(forward=draw(), backward=draw(), weight=[x * rng.choice((0.0, 0.5, 1.0)) for x in draw()],
                      p2p=rng.choice((0.0, 0.0, 0.3, 2.0)))


def _bound(schedule, costs: StageCosts, cores=None) -> float:
    n = schedule.num_stages
    as_list = lambda x: list(x) if not isinstance(x, (int, float)) else [float(x)] * n  # noqa: E731
    return pipeline_lower_bound(owner=schedule.stage_to_rank, forward=as_list(costs.forward),
                                backward=as_list(costs.backward), weight=as_list(costs.weight), p2p=costs.p2p,
                                num_microbatches=schedule.num_microbatches, split_backward=schedule.split_backward,
                                cores=cores)


def test_the_grid_covers_every_family():
    # the families autopar/planner/pipeline_bound.py's docstring names, and naive (Family.bounded), checked below:
    # one dropped from the registry would silently leave the planner's search only its trivial bound for it
    assert COVERED_SCHEDULES == ("naive", "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zb_v")
    assert {s.name for s in SCHEDULES} == set(COVERED_SCHEDULES)
    assert len(SCHEDULES) > 150


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_never_exceeds_either_simulator(seed):
    rng = random.Random(seed)
    tight = 0
    for schedule in SCHEDULES:
        costs = _costs(rng, schedule.num_stages)
        simulated = simulate(schedule, costs=costs).step_time
        bound = _bound(schedule, costs)
        assert bound <= simulated * (1 + 1e-9), (schedule.name, schedule.num_ranks, schedule.num_microbatches)
        tight += bound >= simulated * 0.75
        cores = schedule.num_ranks * rng.choice((0.25, 0.5, 1.0))
        shared = simulate_shared_cores(schedule, costs=costs, cores=cores)
        assert _bound(schedule, costs, cores=cores) <= shared * (1 + 1e-9), (schedule.name, cores)
    assert tight > 0.8 * len(SCHEDULES)  # a bound is only useful when it is close


def test_the_bound_is_exact_where_the_classical_formulas_are():
    one = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    costs = StageCosts(forward=1.0, backward=2.0, weight=0.0)
    assert _bound(one, costs) == simulate(one, costs=costs).step_time == (8 + 3) * 3
    gpipe = build_schedule("gpipe", num_ranks=3, num_microbatches=5)
    assert _bound(gpipe, costs) == simulate(gpipe, costs=costs).step_time


def test_the_relaxed_bound_holds_for_every_cut():
    rng = random.Random(0)
    for _ in range(300):
        pp, m = rng.randint(2, 5), rng.randint(1, 10)
        chunks = [rng.uniform(0.1, 3.0) for _ in range(rng.randint(pp, 12))]
        cuts = sorted(rng.sample(range(1, len(chunks)), pp - 1))
        loads = [sum(chunks[a:b]) for a, b in zip([0, *cuts], [*cuts, len(chunks)])]
        name = rng.choice(("1f1b", "gpipe", "zb_h1") if m >= pp else ("gpipe", "zb_h1"))
        schedule = build_schedule(name, num_ranks=pp, num_microbatches=m)
        weight = [x * rng.random() / 3 for x in loads]  # B and W split the backward where zb_h1 splits it
        costs = StageCosts(forward=[x / 3 for x in loads], backward=[2 * x / 3 - w for x, w in zip(loads, weight)],
                           weight=weight)
        path = sum(loads) - (sum(weight) if schedule.split_backward else 0.0)
        relaxed = relaxed_bound(path=path, work=sum(loads), num_ranks=pp, num_microbatches=m, num_virtual=1)
        assert relaxed <= _bound(schedule, costs) * (1 + 1e-9)


def _in_flight_cases():
    from autopar.runtime.schedules.registry import family, schedule_names
    for name in schedule_names(asynchronous=False):
        row = family(name)
        if row.replicas > 1:
            continue
        for pp, m in ((2, 12), (3, 16), (10, 24), (10, 40)):  # beyond 2·pp (the planner's short schedule) and pp > 8
            v = row.stages_per_rank
            try:
                row.closed_form.peaks(pp, m, v)
            except ScheduleError:
                continue
            yield name, pp, m, v


@pytest.mark.parametrize(("name", "pp", "m", "v"), list(_in_flight_cases()))
def test_the_planner_counts_the_microbatches_the_simulator_holds(name, pp, m, v):
    """What the cost model keeps in flight per rank (a short schedule scaled, or the registry's closed form
    beyond 8 ranks) is the simulator's peak on the whole schedule."""
    from autopar.planner.schedule_shapes import schedule_of

    _schedule, counts = schedule_of(name, pp, m, v)
    full = build_schedule(name, num_ranks=pp, num_microbatches=m, num_virtual=v)
    assert tuple(counts) == simulate(full, costs=StageCosts(forward=1, backward=1, weight=1)).peak_activations
