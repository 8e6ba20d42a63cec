"""Actions and schedules as data: short string form, CSV round trip, printing with marks."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ScheduleError
from autopar.runtime.schedules import Action, ActionKind, Schedule, build_schedule, schedule_names, validate

actions = st.builds(
    Action,
    stage=st.integers(min_value=0, max_value=10_000),
    kind=st.sampled_from(list(ActionKind)),
    microbatch=st.integers(min_value=0, max_value=10_000),
)


def test_action_prints_short_form():
    assert str(Action(1, ActionKind.F, 3)) == "1F3"
    assert str(Action(12, ActionKind.W, 0)) == "12W0"
    assert Action.parse("1F3") == Action(1, ActionKind.F, 3)
    assert Action(0, "B", 2).kind is ActionKind.B  # a kind given as its letter is coerced


@given(actions)
@settings(max_examples=200, deadline=None)
def test_action_parse_round_trips(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F3", "1F", "1X3", "-1F3", "1f3", "1F3x", "1 F 3", "1FB3", "1.0F3"])
def test_action_parse_rejects_bad_strings(text):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


@pytest.mark.parametrize("kwargs", [dict(stage=-1), dict(microbatch=-2), dict(microbatch=-1), dict(stage=1.0),
                                    dict(stage=True), dict(microbatch=1.0), dict(microbatch=True)])
def test_action_rejects_bad_fields(kwargs):
    fields = dict(stage=0, kind=ActionKind.F, microbatch=0) | kwargs
    with pytest.raises(ScheduleError, match="must be an int >= 0"):
        Action(**fields)


def test_action_rejects_unknown_kind():
    with pytest.raises(ScheduleError, match="unknown action kind"):
        Action(0, "X", 0)


def test_schedule_checks_its_shape():
    row = (Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0))
    base = dict(name="x", num_ranks=1, num_stages=1, num_microbatches=1, stage_to_rank=(0,), actions=(row,))
    Schedule(**base)
    with pytest.raises(ScheduleError, match="stage_to_rank has 2 entries for 1 stages"):
        Schedule(**base | dict(stage_to_rank=(0, 0)))
    with pytest.raises(ScheduleError, match="outside 0..0"):
        Schedule(**base | dict(stage_to_rank=(1,)))
    with pytest.raises(ScheduleError, match="actions has 1 rows for 2 ranks"):
        Schedule(**base | dict(num_ranks=2))
    with pytest.raises(ScheduleError, match="num_microbatches must be an int >= 1"):
        Schedule(**base | dict(num_microbatches=0))
    with pytest.raises(ScheduleError, match="must be an Action"):
        Schedule(**base | dict(actions=(("0F0",),)))


def test_schedule_coerces_lists_to_tuples_and_lists_stages_of_rank():
    schedule = build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=2, num_virtual=3)
    assert schedule.stages_of_rank(0) == (0, 2, 4)
    assert schedule.stages_of_rank(1) == (1, 3, 5)
    listed = Schedule(name="x", num_ranks=1, num_stages=1, num_microbatches=1, stage_to_rank=[0],
                      actions=[[Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0)]])
    assert isinstance(listed.actions, tuple) and isinstance(listed.actions[0], tuple)
    assert listed.stage_to_rank == (0,)
    hash(listed)  # frozen and made of tuples, so usable as a key


def test_format_is_one_aligned_line_per_rank_with_marks():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    assert schedule.format() == (
        "schedule '1f1b': 2 ranks, 2 stages, 2 microbatches\n"
        "rank 0 | 0F0  0F1  0B0  0B1\n"
        "rank 1 | 1F0  1B0  1F1  1B1"
    )
    marked = schedule.format(marks={(1, 2)})
    assert marked.splitlines()[2] == "rank 1 | 1F0  1B0 [1F1] 1B1"
    assert "[" not in marked.splitlines()[1]


@pytest.mark.parametrize("name", schedule_names())
def test_csv_round_trips_every_generator(name):
    num_virtual = 2 if name in ("interleaved_1f1b", "looped_bfs", "zb_v") else None
    ranks = 4 if name == "dualpipe" else 3  # DualPipe needs an even number of ranks
    schedule = build_schedule(name, num_ranks=ranks, num_microbatches=6, num_virtual=num_virtual)
    text = schedule.to_csv()
    assert len(text.splitlines()) == ranks
    # replicas, staleness rules and full backwards are not in the actions: they travel as meta
    meta = {k: getattr(schedule, k) for k in ("num_replicas", "microbatch_replica", "staleness")
            if getattr(schedule, k) != getattr(Schedule, k, None) and getattr(schedule, k) not in ((), 1, None)}
    meta.update({"full_backward": True} if schedule.full_backward else {})
    back = Schedule.from_csv(text, name=name, **meta)
    assert back == schedule  # everything else is inferred from the actions


def test_from_csv_takes_meta_and_rejects_unknown_fields():
    text = "0F0,0B0\n\n"
    one = Schedule.from_csv(text, num_ranks=2, num_stages=2, stage_to_rank=(0, 1), name="partial")
    assert one.actions == ((Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0)), ())
    assert one.split_backward is False and one.num_microbatches == 1
    with pytest.raises(ScheduleError, match="unknown schedule fields"):
        Schedule.from_csv(text, num_layers=3)
    with pytest.raises(ScheduleError, match="cannot infer the rank of stage 1"):
        Schedule.from_csv(text, num_stages=2)
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Schedule.from_csv("0F0,0Q0\n")
    assert Schedule.from_csv(" 0F0 , 0B0 ,\n").actions == one.actions[:1]


@pytest.mark.parametrize("field", ["num_ranks", "num_stages", "num_microbatches"])
@pytest.mark.parametrize("value", [True, 1.0, 0])
def test_schedule_counts_are_whole_numbers_of_at_least_one(field, value):
    base = dict(name="x", num_ranks=1, num_stages=1, num_microbatches=1, stage_to_rank=(0,),
                actions=((Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0)),))
    with pytest.raises(ScheduleError, match=f"{field} must be an int >= 1, got {value!r}"):
        Schedule(**base | {field: value})


def _two_replicas(**fields) -> Schedule:
    """Two chains of one stage each on one rank (shape only: construction does not validate the order)."""
    row = tuple(Action.parse(c) for c in ("0F0", "1F1", "1B1", "0B0"))
    base = dict(name="x", num_ranks=1, num_stages=2, num_microbatches=2, stage_to_rank=(0, 0), actions=(row,),
                num_replicas=2, microbatch_replica=(0, 1))
    return Schedule(**base | fields)


@pytest.mark.parametrize("replicas", [True, 2.0, 0, 3])
def test_num_replicas_is_a_whole_number_dividing_the_stages(replicas):
    with pytest.raises(ScheduleError, match=f"num_replicas must be an int >= 1 dividing num_stages=2, got {replicas!r}"):
        _two_replicas(num_replicas=replicas)


@pytest.mark.parametrize("routes", [(0, 2), (-1, 1), (0,), (0, 1, 1)])
def test_each_microbatch_is_routed_to_one_replica_of_the_schedule(routes):
    validate(_two_replicas())
    with pytest.raises(ScheduleError, match=r"microbatch_replica must give one replica in 0\.\.1 per microbatch"):
        _two_replicas(microbatch_replica=routes)
    with pytest.raises(ScheduleError, match="a schedule with 2 replicas needs microbatch_replica"):
        _two_replicas(microbatch_replica=())


def test_the_header_names_two_replicas_and_not_one():
    assert _two_replicas().format().splitlines()[0] == (
        "schedule 'x': 1 ranks, 2 stages, 2 microbatches, 2 replicas")
    one = build_schedule("gpipe", num_ranks=1, num_microbatches=1)
    assert one.format().splitlines()[0] == "schedule 'gpipe': 1 ranks, 1 stages, 1 microbatches"


def _one_rank(cells: str, **fields) -> Schedule:
    """One rank running two stages (shape only: construction does not validate counts or order)."""
    row = tuple(Action.parse(c) for c in cells.split())
    base = dict(name="x", num_ranks=1, num_stages=2, num_microbatches=3, stage_to_rank=(0, 0), actions=(row,))
    return Schedule(**base | fields)


def test_an_overlapped_pair_is_a_forward_then_a_backward_of_another_stage():
    pairs = _one_rank("0F0 1B0 0F1 1B1", overlapped=((0, 2),))  # the first and the second-to-last index
    assert pairs.cells(0) == ["0F0&1B0", "0F1&1B1"]
    # a B first (1), a B of the same stage (2, 5), a forward next (4), no next action (7), outside the row
    for index in (1, 2, 4, 5, 7, 8, -1):
        with pytest.raises(ScheduleError, match=f"overlapped pair at index {index} of rank 0 is not a forward"):
            _one_rank("0F0 1B0 0F1 0B1 0F2 1F1 1B1 1F2", overlapped=((index,),))
    # an index before the row is refused even where Python's row[-1], row[0] would read as a pair
    with pytest.raises(ScheduleError, match="overlapped pair at index -1 of rank 0 is not a forward"):
        _one_rank("1B0 0F1 0B1 0F0", overlapped=((-1,),))
    with pytest.raises(ScheduleError, match="overlapped has 2 rows for 1 ranks"):
        _one_rank("0F0 1B0", overlapped=((0,), ()))


@pytest.mark.parametrize("ranks", [10, 11])
def test_rank_labels_are_as_wide_as_the_last_ones(ranks):
    lines = build_schedule("gpipe", num_ranks=ranks, num_microbatches=1).format().splitlines()[1:]
    width = len(f"rank {ranks - 1}")
    assert [line[:width + 2] for line in lines] == [f"rank {r}".ljust(width) + " |" for r in range(ranks)]


def test_the_memo_is_not_part_of_a_schedules_identity():
    used = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    validate(used)  # computes and keeps its dependencies (deps.needs) in the memo
    fresh = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    assert used.memo and not fresh.memo
    assert used == fresh and hash(used) == hash(fresh) and repr(used) == repr(fresh)
    assert "memo" not in repr(used)
    assert not dataclasses.replace(used).memo


@pytest.mark.parametrize("value", [True, 1.0, "1"])
@pytest.mark.parametrize("field", ["stage_to_rank", "microbatch_replica", "overlapped"])
def test_the_index_fields_hold_ints_only(field, value):
    given = {"stage_to_rank": (0, value), "microbatch_replica": (0, value), "overlapped": ((value,),)}[field]
    with pytest.raises(ScheduleError, match=f"schedule {field} must hold ints"):
        _two_replicas(**{field: given})


def test_a_plain_schedules_options_are_off():
    plain = _one_rank("0F0 0B0")
    assert (plain.split_backward, plain.num_replicas, plain.microbatch_replica, plain.forward_only, plain.staleness,
            plain.overlapped, plain.full_backward) == (False, 1, (), False, None, (), False)
    assert Schedule.from_csv("0F0,0B0,0W0\n").full_backward is False


def test_a_stage_is_owned_by_a_rank_of_the_schedule():
    with pytest.raises(ScheduleError, match=r"stage_to_rank names ranks \[-1\] outside 0..0"):
        _one_rank("0F0 0B0", stage_to_rank=(0, -1))


def test_an_empty_csv_has_one_stage_and_one_microbatch():
    empty = Schedule.from_csv("", num_ranks=2, stage_to_rank=(1,))
    assert (empty.num_stages, empty.num_microbatches, empty.actions) == (1, 1, ((), ()))


def test_a_cell_joins_at_most_two_actions():
    with pytest.raises(ScheduleError, match="a pair joins exactly two actions"):
        Schedule.from_csv("0F0&1B0&1W0\n")
