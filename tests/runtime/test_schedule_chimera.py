"""Chimera and forward-only schedules as data: placement, routing, validator, simulator figures."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.errors import ScheduleError
from autopar.runtime.schedules import (
    Action, Schedule, StageCosts, build_schedule, chimera, dependencies, forward_only, one_f_one_b, simulate,
    validate,
)
from autopar.runtime.schedules.list_scheduler import list_schedule

EQUAL = StageCosts(forward=1, backward=1, weight=0)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_chimera_bubble_is_the_papers_with_m_equal_p(p):
    """Li and Hoefler 2021, table 1: (D - 2) / (2N + D - 2) with equal forward and backward costs."""
    result = simulate(chimera(num_ranks=p, num_microbatches=p), costs=EQUAL)
    assert result.mean_bubble == pytest.approx((p - 2) / (2 * p + p - 2), abs=1e-9)
    one_f = simulate(one_f_one_b(num_ranks=p, num_microbatches=p), costs=EQUAL).mean_bubble
    assert result.mean_bubble < one_f


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16), (3, 5), (1, 3)])
def test_chimera_is_valid_and_never_worse_than_1f1b(p, m):
    schedule = chimera(num_ranks=p, num_microbatches=m)
    validate(schedule)
    assert schedule.stage_to_rank == tuple(range(p)) + tuple(reversed(range(p)))
    assert schedule.microbatch_replica == tuple(i % 2 for i in range(m))
    if m >= p:
        assert simulate(schedule, costs=EQUAL).mean_bubble <= simulate(
            one_f_one_b(num_ranks=p, num_microbatches=m), costs=EQUAL).mean_bubble + 1e-9


def test_chimera_routes_each_microbatch_through_its_replica_only():
    schedule = chimera(num_ranks=2, num_microbatches=2)
    assert list(schedule.chain(0)) == [0, 1] and list(schedule.chain(1)) == [2, 3]
    assert [str(d) for d in dependencies(Action.parse("2F1"), num_stages=4, num_replicas=2)] == []
    assert [str(d) for d in dependencies(Action.parse("2B1"), num_stages=4, num_replicas=2)] == ["2F1", "3B1"]
    assert [str(d) for d in dependencies(Action.parse("1B0"), num_stages=4, num_replicas=2)] == ["1F0"]
    # a microbatch on the other replica's stage is marked
    rows = [list(r) for r in schedule.actions]
    rows[0] = [Action(3, a.kind, 0) if a.stage == 3 and a.microbatch == 1 else a for a in rows[0]]
    with pytest.raises(ScheduleError, match="outside its replica's stages") as info:
        validate(dataclasses.replace(schedule, actions=tuple(map(tuple, rows))))
    assert "[3F0]" in str(info.value)


def test_schedule_checks_its_replicas():
    base = chimera(num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="needs microbatch_replica"):
        dataclasses.replace(base, microbatch_replica=())
    with pytest.raises(ScheduleError, match="num_replicas must be an int >= 1 dividing"):
        dataclasses.replace(base, num_replicas=3)
    with pytest.raises(ScheduleError, match="one replica in 0..1 per microbatch"):
        dataclasses.replace(base, microbatch_replica=(0, 2))


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", None), ("interleaved_1f1b", 2), ("zb_v", None),
                                               ("chimera", None), ("looped_bfs", 3)])
def test_forward_only_keeps_the_placement_and_holds_nothing(name, virtual):
    training = build_schedule(name, num_ranks=2, num_microbatches=4, num_virtual=virtual)
    inference = forward_only(training)
    validate(inference)
    assert inference.forward_only and inference.stage_to_rank == training.stage_to_rank
    assert all(a.kind.value == "F" for row in inference.actions for a in row)
    assert sum(map(len, inference.actions)) == training.parts * 4
    result = simulate(inference, costs=EQUAL)
    assert result.peak_activations == (0, 0)
    with pytest.raises(ScheduleError, match="forward-only schedule"):
        validate(dataclasses.replace(inference, actions=((Action(0, "B", 0),) + inference.actions[0],)
                                     + inference.actions[1:]))


def test_forward_only_runs_microbatches_depth_first():
    inference = forward_only(build_schedule("zb_v", num_ranks=2, num_microbatches=2))
    assert inference.to_csv() == "0F0,3F0,0F1,3F1\n1F0,2F0,1F1,2F1\n"
    assert forward_only(inference, num_microbatches=3).num_microbatches == 3


def test_forward_only_routes_microbatches_only_where_there_are_two_replicas():
    """One replica: no routes, the schedule a CSV reads back; Chimera's two: every microbatch through replica 0."""
    inference = forward_only(one_f_one_b(num_ranks=2, num_microbatches=2))
    assert inference.microbatch_replica == ()
    assert inference == Schedule.from_csv("0F0,0F1\n1F0,1F1\n", name="1f1b:forward_only", forward_only=True)
    assert forward_only(chimera(num_ranks=2, num_microbatches=3)).microbatch_replica == (0, 0, 0)


def test_list_scheduling_starts_a_ready_backward_before_a_ready_forward_of_an_older_microbatch():
    """Backward first, then the lowest microbatch: microbatch 0 comes up from rank 1 while microbatch 1,
    on rank 0 alone, finishes its forward; at t = 1 rank 0 has 0B1 and 0F0 ready and runs 0B1."""
    rows = list_schedule(num_ranks=2, stage_to_rank=(0, 1), chains=[(1, 0), (0,)], cap=lambda stage: 2)
    assert [" ".join(map(str, row)) for row in rows] == ["0F1 0B1 0F0 0B0", "1F0 1B0"]
