"""The validator rejects broken schedules and prints them with the bad steps marked."""
from __future__ import annotations

import re

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ScheduleError
from autopar.runtime.schedules import Action, Schedule, build_schedule, schedule_names, validate

BASES = [
    ("1f1b", 3, 4, None),
    ("gpipe", 2, 3, None),
    ("interleaved_1f1b", 2, 2, 2),
    ("looped_bfs", 2, 3, 2),
    ("zb_h1", 3, 4, None),
    ("zb_h2", 3, 5, None),
    ("zb_v", 2, 3, None),
    ("dualpipev", 2, 4, None),
    ("dualpipe", 4, 8, None),
    ("naive", 3, 2, None),
    ("chimera", 4, 4, None),
    ("pipedream", 3, 4, None),
    ("pipedream_2bw", 2, 4, None),
    ("pipemare", 3, 2, None),
]
bases = st.sampled_from(BASES).map(
    lambda b: build_schedule(b[0], num_ranks=b[1], num_microbatches=b[2], num_virtual=b[3])
)


def _with_rows(schedule: Schedule, rows) -> Schedule:
    """``schedule`` with other action lists (and no overlapped pairs: their indices are of the old lists)."""
    return dataclasses.replace(schedule, actions=tuple(tuple(row) for row in rows), overlapped=())


def _error(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return info.value


def _grid(message: str) -> str:
    """The schedule printed at the end of an error message."""
    return message[message.rindex("\nschedule "):]


@pytest.mark.parametrize("base", BASES, ids=lambda b: b[0])
def test_generated_schedules_pass(base):
    validate(build_schedule(base[0], num_ranks=base[1], num_microbatches=base[2], num_virtual=base[3]))


@given(bases, st.data())
@settings(max_examples=60, deadline=None)
def test_dropped_action_is_reported_missing(schedule, data):
    rank = data.draw(st.sampled_from([r for r, row in enumerate(schedule.actions) if row]))
    index = data.draw(st.integers(0, len(schedule.actions[rank]) - 1))
    dropped = schedule.actions[rank][index]
    rows = [list(row) for row in schedule.actions]
    del rows[rank][index]
    broken = _with_rows(schedule, rows)
    error = _error(broken)
    assert "does not run every action exactly once" in str(error)
    assert f"{dropped} is missing (it belongs on rank {rank})" in str(error)
    assert broken.format().splitlines()[0] in str(error)  # the schedule is printed


@given(bases, st.data())
@settings(max_examples=60, deadline=None)
def test_duplicated_action_is_marked(schedule, data):
    rank = data.draw(st.sampled_from([r for r, row in enumerate(schedule.actions) if row]))
    index = data.draw(st.integers(0, len(schedule.actions[rank]) - 1))
    copy = schedule.actions[rank][index]
    rows = [list(row) for row in schedule.actions]
    rows[rank].insert(index + 1, copy)
    message = str(_error(_with_rows(schedule, rows)))
    assert f"rank {rank} step {index + 1}: {copy} repeats rank {rank} step {index}" in message
    grid_line = next(line for line in message.splitlines() if line.startswith(f"rank {rank} |"))
    assert f" {copy} [{copy}]" in grid_line


@given(bases, st.data())
@settings(max_examples=60, deadline=None)
def test_action_on_the_wrong_rank_is_marked(schedule, data):
    if schedule.num_ranks < 2:
        return
    rank = data.draw(st.sampled_from([r for r, row in enumerate(schedule.actions) if row]))
    index = data.draw(st.integers(0, len(schedule.actions[rank]) - 1))
    other = data.draw(st.sampled_from([r for r in range(schedule.num_ranks) if r != rank]))
    rows = [list(row) for row in schedule.actions]
    moved = rows[rank].pop(index)
    rows[other].append(moved)
    message = str(_error(_with_rows(schedule, rows)))
    assert f"{moved} belongs to rank {rank}" in message
    grid_line = next(line for line in message.splitlines() if line.startswith(f"rank {other} |"))
    assert grid_line.endswith(f"[{moved}]")


def _runs_to_completion(schedule: Schedule) -> bool:
    """An oracle written here, apart from the validator and runtime/schedules/deps.py: every rank runs
    its row in order, each action once what it needs has run (F(s, i) after F(s-1, i); B(s, i) after
    F(s, i) and B(s+1, i); W(s, i) after B(s, i); "first" and "last" within a replica's chain of
    stages). True when every row finishes, False when the ranks stall."""
    parts = schedule.num_stages // schedule.num_replicas

    def needs(a: Action) -> list[tuple[int, str, int]]:
        first, last = a.stage % parts == 0, a.stage % parts == parts - 1
        kind = a.kind.name
        if kind == "F":
            return [] if first else [(a.stage - 1, "F", a.microbatch)]
        if kind == "B":
            return [(a.stage, "F", a.microbatch)] + ([] if last else [(a.stage + 1, "B", a.microbatch)])
        return [(a.stage, "B", a.microbatch)]

    done, cursor, moved = set(), [0] * len(schedule.actions), True
    while moved:
        moved = False
        for rank, row in enumerate(schedule.actions):
            while cursor[rank] < len(row) and all(d in done for d in needs(row[cursor[rank]])):
                a = row[cursor[rank]]
                done.add((a.stage, a.kind.name, a.microbatch))
                cursor[rank], moved = cursor[rank] + 1, True
    return all(c == len(row) for c, row in zip(cursor, schedule.actions))


@given(bases, st.data())
@settings(max_examples=100, deadline=None)
def test_swapped_actions_are_accepted_exactly_when_they_still_run(schedule, data):
    """A swap on one rank keeps counts and placement; the validator accepts it exactly when the
    oracle above runs it to the end, and marks a step otherwise (a validator that accepted
    everything, or rejected everything, fails here)."""
    rank = data.draw(st.sampled_from([r for r, row in enumerate(schedule.actions) if len(row) > 1]))
    i = data.draw(st.integers(0, len(schedule.actions[rank]) - 2))
    j = data.draw(st.integers(i + 1, len(schedule.actions[rank]) - 1))
    rows = [list(row) for row in schedule.actions]
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    swapped = _with_rows(schedule, rows)
    if _runs_to_completion(swapped):
        validate(swapped)
        return
    message = str(_error(swapped))  # counts and placement are intact, so order or deadlock failed
    assert "orders actions before" in message or "deadlocks" in message
    if "deadlocks" in message:  # the cycle starts at its lowest (rank, step), which waits on another rank
        assert re.search(r"the cycle: \d+[FBW]\d+ \(rank \d+ step \d+\) waits for its input ", message), message
    assert "[" in _grid(message)  # a step is marked


def test_the_oracle_tells_a_runnable_swap_from_a_stalled_one():
    """The oracle itself: a generated schedule runs; its first rank's F and B of microbatch 0 swapped stalls."""
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    assert _runs_to_completion(schedule)
    rows = [list(row) for row in schedule.actions]
    first_b = next(k for k, a in enumerate(rows[0]) if str(a) == "0B0")
    rows[0][0], rows[0][first_b] = rows[0][first_b], rows[0][0]
    assert not _runs_to_completion(_with_rows(schedule, rows))


def test_backward_before_its_forward_is_marked():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    rows = [list(row) for row in schedule.actions]
    rows[1][0], rows[1][1] = rows[1][1], rows[1][0]  # 1B0 before 1F0
    message = str(_error(_with_rows(schedule, rows)))
    assert "rank 1 step 0: 1B0 runs before 1F0 (step 1), which it needs" in message
    assert "rank 1 |[1B0] 1F0  1F1  1B1" in message


def test_weight_before_its_backward_is_marked():
    schedule = build_schedule("zb_h1", num_ranks=1, num_microbatches=1)
    assert schedule.to_csv() == "0F0,0B0,0W0\n"
    message = str(_error(Schedule.from_csv("0F0,0W0,0B0", name="zb")))
    assert "0W0 runs before 0B0" in message and "rank 0 | 0F0 [0W0] 0B0" in message


def test_deadlock_names_each_blocked_rank_and_what_it_waits_on():
    # Rank 0 runs microbatches one by one while rank 1 wants both forwards first: each waits on the other.
    schedule = Schedule.from_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", name="crossed")
    error = _error(schedule)
    message = str(error)
    assert "schedule 'crossed' deadlocks" in message
    assert "rank 0 is blocked at 0B0 (step 1) waiting on 1B0 (rank 1 step 2" in message
    assert "rank 1 is blocked at 1F1 (step 1) waiting on 0F1 (rank 0 step 2" in message
    assert ("the cycle: 0B0 (rank 0 step 1) waits for its input 1B0 (rank 1 step 2), which runs after 1F1 "
            "(rank 1 step 1), which waits for its input 0F1 (rank 0 step 2), which runs after 0B0 (rank 0 step 1)"
            in message)
    assert message.endswith(  # the cycle's actions are marked
        "schedule 'crossed': 2 ranks, 2 stages, 2 microbatches\n"
        "rank 0 | 0F0 [0B0][0F1] 0B1\n"
        "rank 1 | 1F0 [1F1][1B0] 1B1"
    )
    assert "reorder" in error.fix


def test_two_ranks_each_receiving_first_are_reported_as_their_cycle():
    """Rank 0 waits for microbatch 0's gradient before sending microbatch 1; rank 1 starts with microbatch 1."""
    schedule = Schedule.from_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", name="receive_first")
    message = str(_error(schedule))
    assert ("the cycle: 0B0 (rank 0 step 1) waits for its input 1B0 (rank 1 step 3), which runs after 1F1 "
            "(rank 1 step 0), which waits for its input 0F1 (rank 0 step 2), which runs after 0B0" in message)
    assert message.endswith("rank 0 | 0F0 [0B0][0F1] 0B1\nrank 1 |[1F1] 1B1  1F0 [1B0]")


def test_a_cycle_through_three_ranks_names_every_wait():
    """1F1B on 3 ranks with rank 2 taking microbatch 1 first: rank 0 and 1 wait round through rank 2."""
    rows = ["0F0,0F1,0B0,0F2,0B1,0B2", "1F0,1B0,1F1,1F2,1B1,1B2", "2F1,2B1,2F0,2B0,2F2,2B2"]
    message = str(_error(Schedule.from_csv("\n".join(rows) + "\n", name="three")))
    cycle = message[message.index("the cycle: "):].split(". Where")[0]
    waits = cycle.removeprefix("the cycle: ").split(", which ")
    assert waits[0].startswith("1B0 (rank 1 step 1) waits for its input 2B0")
    assert len(waits) >= 4 and waits[-1].endswith("1B0 (rank 1 step 1)")
    ranks = {int(w) for w in re.findall(r"\(rank (\d) step", cycle)}
    assert ranks == {1, 2}


def test_v_shape_deadlock_across_three_ranks():
    # ZB-V with the up-leg forward of rank 1 moved before the down-leg forward it transitively needs.
    schedule = build_schedule("zb_v", num_ranks=2, num_microbatches=1)
    assert schedule.to_csv() == "0F0,3F0,3B0,3W0,0B0,0W0\n1F0,2F0,2B0,2W0,1B0,1W0\n"
    rows = [list(row) for row in schedule.actions]
    rows[0] = [rows[0][1], rows[0][0], *rows[0][2:]]  # 3F0 before 0F0: same rank, needs 0F0 via 1F0, 2F0
    message = str(_error(_with_rows(schedule, rows)))
    assert "deadlocks" in message and "rank 0 is blocked at 3F0 (step 0) waiting on 2F0" in message


def test_actions_outside_the_schedule_are_marked():
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    rows = [list(row) for row in schedule.actions]
    rows[0].append(Action.parse("0F7"))
    rows[1].append(Action.parse("1W0"))
    message = str(_error(_with_rows(schedule, rows)))
    assert "0F7 is outside stages 0..1 or microbatches 0..1" in message
    assert "1W0 is a W in a schedule that does not split backward" in message
    assert "[0F7]" in message and "[1W0]" in message


def test_split_schedule_needs_every_weight_gradient():
    schedule = build_schedule("zb_h2", num_ranks=2, num_microbatches=2)
    rows = [[a for a in row if str(a) != "1W1"] for row in schedule.actions]
    assert "1W1 is missing" in str(_error(_with_rows(schedule, rows)))


def test_every_registry_name_is_covered_by_the_mutation_bases():
    assert {b[0] for b in BASES} == set(schedule_names())


@pytest.mark.parametrize("extra", [20, 21, 25])
def test_an_error_lists_twenty_problems_and_counts_the_rest(extra):
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    rows = [list(row) for row in schedule.actions]
    rows[1] += [Action.parse(f"1F{k}") for k in range(2, 2 + extra)]
    message = str(_error(_with_rows(schedule, rows)))
    listed = [line.strip().split(". Where")[0] for line in message.splitlines() if line.startswith("  rank 1 step ")]
    assert listed == [f"rank 1 step {4 + k}: 1F{2 + k} is outside stages 0..1 or microbatches 0..1" for k in range(20)]
    assert message.count(" more") == (extra > 20)
    if extra > 20:
        assert f"\n  ... and {extra - 20} more" in message


def test_each_problem_names_its_rank_and_step():
    """Positions where rank, step and 0 all differ: rank 1 step 2 (the messages' indices are not swapped)."""
    outside = Schedule.from_csv("0F0,0B0\n1F0,1B0,1F5\n", name="x", num_microbatches=1)
    assert "\n  rank 1 step 2: 1F5 is outside stages 0..1 or microbatches 0..0" in str(_error(outside))
    validate(Schedule.from_csv("0F0,0F1\n1F0,1F1\n", name="x", forward_only=True))  # forwards only: runs
    forward = Schedule.from_csv("0F0,0F1\n1F0,1F1,1B0\n", name="x", forward_only=True)
    assert "\n  rank 1 step 2: 1B0 is a B in a forward-only schedule" in str(_error(forward))
    moved = Schedule.from_csv("0F0,0B0\n1F0,1B0,0F1,0B1\n", name="x", stage_to_rank=(0, 1))
    assert "\n  rank 1 step 2: 0F1 belongs to rank 0, which owns stage 0" in str(_error(moved))
    stage = Schedule.from_csv("0F0,0B0\n1F0,1B0,2F0\n", name="x", num_stages=2, stage_to_rank=(0, 1))
    assert "\n  rank 1 step 2: 2F0 is outside stages 0..1 or microbatches 0..0" in str(_error(stage))
    weight = Schedule.from_csv("0F0,0B0\n1F0,1B0,1W0\n", name="x", split_backward=False)
    assert "\n  rank 1 step 2: 1W0 is a W in a schedule that does not split backward" in str(_error(weight))
    replica = Schedule.from_csv("0F0,0B0,3F1,3B1\n1F0,1B0,2F0,2F1,2B1\n", name="x", stage_to_rank=(0, 1, 1, 0),
                                num_replicas=2, microbatch_replica=(0, 1))
    assert ("\n  rank 1 step 2: 2F0 runs microbatch 0 on stage 2, outside its replica's stages [0, 1]"
            in str(_error(replica)))  # microbatch 0 goes through replica 0
    order = Schedule.from_csv("0B0,0F0\n1F0,1B0\n", name="x")
    assert "\n  rank 0 step 0: 0B0 runs before 0F0 (step 1), which it needs" in str(_error(order))


def test_a_cycle_folds_each_run_of_one_ranks_waits_into_one():
    """Rank 0 takes 0B1 before 0B0, rank 1 runs every forward first: 1B1 waits (by order) on 1B0, which waits
    on 1F2; 0F2 on 0B0, which waits on 0B1. Each run of two order waits reads as one, after its earliest step."""
    schedule = Schedule.from_csv("0F0,0F1,0B1,0B0,0F2,0B2\n1F0,1F1,1F2,1B0,1B1,1B2\n", name="late")
    message = str(_error(schedule))
    assert ("the cycle: 0B1 (rank 0 step 2) waits for its input 1B1 (rank 1 step 4), which runs after 1F2 "
            "(rank 1 step 2), which waits for its input 0F2 (rank 0 step 4), which runs after 0B1 (rank 0 step 2). "
            in message)
