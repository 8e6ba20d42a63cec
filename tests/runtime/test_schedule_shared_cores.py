"""The shared-core simulator (ranks as processes on fewer cores) against the plain simulator and its bounds.

- With a core per rank it is the plain simulator.
- On one core nothing overlaps and the core is never idle (a validated schedule always has a runnable
  rank), so the step is exactly the total work.
- In between, the step lies between the total work over the cores and the total work, and never
  below the one-core-per-rank step.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ScheduleError
from autopar.runtime.schedules import StageCosts, build_schedule, simulate
from autopar.runtime.schedules.shared_cores import simulate_shared_cores

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_h1", 1), ("zb_h2", 1),
             ("zb_v", 2)]


def _costs(schedule, f, b, w, p2p=0.0):
    n = schedule.num_stages
    return StageCosts(forward=[f * (1 + s % 2) for s in range(n)], backward=[b] * n, weight=[w] * n, p2p=p2p)


def _work(schedule, costs) -> float:
    return sum(costs.cost(a, num_stages=schedule.num_stages, split_backward=schedule.split_backward)
               for row in schedule.actions for a in row)


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(SCHEDULES), ranks=st.sampled_from([2, 4]), mult=st.integers(1, 3),
       f=st.floats(0.1, 3), b=st.floats(0.1, 3), w=st.floats(0.0, 2))
def test_bounds_and_limits(which, ranks, mult, f, b, w):
    name, v = which
    schedule = build_schedule(name, num_ranks=ranks, num_microbatches=ranks * mult, num_virtual=v)
    costs = _costs(schedule, f, b, w)
    alone = simulate(schedule, costs=costs).step_time
    work = _work(schedule, costs)
    assert simulate_shared_cores(schedule, costs=costs, cores=ranks) == pytest.approx(alone, rel=1e-9)
    assert simulate_shared_cores(schedule, costs=costs, cores=ranks + 3) == pytest.approx(alone, rel=1e-9)
    assert simulate_shared_cores(schedule, costs=costs, cores=1) == pytest.approx(work, rel=1e-9)
    shared = simulate_shared_cores(schedule, costs=costs, cores=ranks / 2)
    assert max(alone, work / (ranks / 2)) - 1e-9 <= shared <= work + 1e-9


def test_transfers_still_delay_dependent_actions():
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=1)
    costs = StageCosts(forward=1, backward=1, weight=0, p2p=0.5)  # F0, (p2p) F1, B1, (p2p) B0
    assert simulate_shared_cores(schedule, costs=costs, cores=1) == pytest.approx(5.0)


def test_cores_must_be_positive():
    with pytest.raises(ScheduleError, match="cores"):
        simulate_shared_cores(build_schedule("1f1b", num_ranks=2, num_microbatches=2),
                              costs=StageCosts(forward=1, backward=1, weight=0), cores=0)


def test_a_schedule_is_validated_unless_the_caller_did_and_one_that_stalls_is_refused():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    broken = dataclasses.replace(schedule, actions=(schedule.actions[0], schedule.actions[1][:-1]))  # no 1B1
    costs = StageCosts(forward=1, backward=1, weight=0)
    with pytest.raises(ScheduleError, match="1B1 is missing"):
        simulate_shared_cores(broken, costs=costs, cores=1)
    with pytest.raises(ScheduleError, match="the shared-core simulation stalled"):  # 0B1 waits on 1B1 forever
        simulate_shared_cores(broken, costs=costs, cores=1, validated=True)


def test_whole_unit_costs_give_an_exact_step():
    """The docstring's example, exactly: events land on whole units, so nothing is left to rounding."""
    schedule = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    costs = StageCosts(forward=1, backward=2, weight=0)
    assert simulate_shared_cores(schedule, costs=costs, cores=4) == 33.0
    assert simulate_shared_cores(schedule, costs=costs, cores=2) == 51.0  # 96 s of work on 2 cores, fill, drain
    assert simulate_shared_cores(schedule, costs=costs, cores=1) == 96.0
