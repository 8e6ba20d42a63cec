"""Schedule generators: golden action lists, validity over a grid of sizes, and the registry's errors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ScheduleError
from autopar.runtime.schedules import (
    Action,
    ActionKind,
    Schedule,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    naive,
    one_f_one_b,
    schedule_names,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)

# Golden orders, one CSV row per rank. The interleaved, looped-BFS, ZB-H1 and ZB-V orders were checked
# equal to torch.distributed.pipelining 2.13's generators (ScheduleInterleaved1F1B, ScheduleLoopedBFS,
# ScheduleInterleavedZeroBubble with one stage per rank, ScheduleZBVZeroBubble) with their idle slots
# dropped, over p = 1..5, m = 1..12, v = 2..3.
GOLDEN = {
    ("naive", 2, 2, None): """
0F0,0B0,0F1,0B1
1F0,1B0,1F1,1B1
""",
    ("gpipe", 3, 4, None): """
0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3
1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3
2F0,2F1,2F2,2F3,2B0,2B1,2B2,2B3
""",
    ("1f1b", 4, 8, None): """
0F0,0F1,0F2,0F3,0B0,0F4,0B1,0F5,0B2,0F6,0B3,0F7,0B4,0B5,0B6,0B7
1F0,1F1,1F2,1B0,1F3,1B1,1F4,1B2,1F5,1B3,1F6,1B4,1F7,1B5,1B6,1B7
2F0,2F1,2B0,2F2,2B1,2F3,2B2,2F4,2B3,2F5,2B4,2F6,2B5,2F7,2B6,2B7
3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5,3F6,3B6,3F7,3B7
""",
    ("interleaved_1f1b", 2, 4, 2): """
0F0,0F1,2F0,2F1,0F2,2B0,0F3,2B1,2F2,0B0,2F3,0B1,2B2,2B3,0B2,0B3
1F0,1F1,3F0,3B0,3F1,3B1,1F2,1B0,1F3,1B1,3F2,3B2,3F3,3B3,1B2,1B3
""",
    ("looped_bfs", 2, 3, 2): """
0F0,0F1,0F2,2F0,2F1,2F2,2B2,2B1,2B0,0B2,0B1,0B0
1F0,1F1,1F2,3F0,3F1,3F2,3B2,3B1,3B0,1B2,1B1,1B0
""",
    ("zb_h1", 3, 4, None): """
0F0,0F1,0F2,0B0,0W0,0F3,0B1,0W1,0B2,0W2,0B3,0W3
1F0,1F1,1B0,1F2,1B1,1W0,1F3,1B2,1W1,1B3,1W2,1W3
2F0,2B0,2F1,2B1,2F2,2B2,2W0,2F3,2B3,2W1,2W2,2W3
""",
    ("zb_h2", 3, 6, None): """
0F0,0F1,0F2,0F3,0F4,0B0,0W0,0F5,0B1,0W1,0B2,0W2,0B3,0W3,0B4,0W4,0B5,0W5
1F0,1F1,1F2,1B0,1F3,1B1,1F4,1B2,1W0,1F5,1B3,1W1,1B4,1W2,1B5,1W3,1W4,1W5
2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3,2F4,2B4,2W0,2F5,2B5,2W1,2W2,2W3,2W4,2W5
""",
    ("zb_v", 2, 4, None): """
0F0,0F1,0F2,3F0,3B0,3W0,3F1,3B1,3W1,0F3,0B0,0W0,3F2,3B2,3W2,0B1,0W1,3F3,3B3,3W3,0B2,0W2,0B3,0W3
1F0,2F0,1F1,2F1,2B0,2W0,1F2,1B0,1W0,2F2,2B1,2W1,1F3,1B1,1W1,2F3,2B2,2W2,1B2,2B3,1B3,1W2,2W3,1W3
""",
    ("dualpipev", 2, 4, None): """
0F0,0F1,0F2,3F0,3B0,3W0,3F1,0F3&3B1,3W1,3F2&0B0,0W0,3B2,3W2,3F3&0B1,0W1,3B3,3W3,0B2,0W2,0B3,0W3
1F0,2F0,1F1,2F1,1F2,2B0,2W0,2F2&1B0,1W0,1F3&2B1,2W1,2F3&1B1,1W1,2B2,2W2,1B2,1W2,2B3,1B3,2W3,1W3
""",
    # DualPipe, derived by hand from DeepSeek's eight phases (p=2: both ranks are "middle" ranks)
    ("dualpipe", 2, 4, None): """
0F0,3F1,0F2,3B1,3W1,3F3&0B0,0W0,3B3,3W3,0B2,0W2
2F1,1F0,2F3,1B0,1W0,1F2&2B1,2W1,1B2,1W2,2B3,2W3
""",
    ('chimera', 4, 4, None): """
0F0,0F2,7F1,7B1,7F3,7B3,0B0,0B2
1F0,6F1,1F2,6F3,6B1,1B0,6B3,1B2
5F1,2F0,5F3,2F2,2B0,5B1,2B2,5B3
4F1,4F3,3F0,3B0,3F2,3B2,4B1,4B3
""",
    ('pipedream', 2, 3, None): """
0F0,0F1,0B0,0F2,0B1,0B2
1F0,1B0,1F1,1B1,1F2,1B2
""",
    ('pipedream_2bw', 2, 2, None): """
0F0,0F1,0B0,0B1
1F0,1B0,1F1,1B1
""",
    ('pipemare', 3, 3, None): """
0F0,0F1,0F2,0B0,0B1,0B2
1F0,1F1,1B0,1F2,1B1,1B2
2F0,2B0,2F1,2B1,2F2,2B2
""",
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"{k[0]}-p{k[1]}-m{k[2]}")
def test_golden_orders(key):
    name, p, m, v = key
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_virtual=v)
    assert schedule.to_csv() == GOLDEN[key].lstrip("\n")
    meta = dict(num_replicas=schedule.num_replicas, microbatch_replica=schedule.microbatch_replica,
                staleness=schedule.staleness, full_backward=schedule.full_backward)
    assert Schedule.from_csv(GOLDEN[key], name=name, stage_to_rank=schedule.stage_to_rank, **meta) == schedule
    validate(schedule)


def test_registry_knows_every_family():
    assert schedule_names() == (
        "naive", "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zb_v", "dualpipev",
        "dualpipe", "chimera", "pipedream", "pipedream_2bw", "pipemare",
    )
    assert schedule_names(asynchronous=False) == schedule_names()[:11]
    assert {key[0] for key in GOLDEN} == set(schedule_names())


def _expected_rejection(name: str, p: int, m: int, v: int | None) -> str | None:
    """The error a generator must raise for these sizes, or None if it must build."""
    if name == "1f1b" and m < p:
        return "needs num_microbatches >= "
    if name == "interleaved_1f1b" and m % p:
        return "multiple of num_ranks"
    if name == "pipedream_2bw" and m < p:
        return "needs num_microbatches >= "
    if name == "dualpipe" and p % 2:
        return "needs an even number of pipeline ranks"
    return None


@given(
    name=st.sampled_from(schedule_names()),
    p=st.integers(min_value=1, max_value=6),
    m=st.integers(min_value=1, max_value=14),
    v=st.integers(min_value=2, max_value=4),
)
@settings(max_examples=250, deadline=None)
def test_every_generator_is_valid_over_a_grid(name, p, m, v):
    num_virtual = v if name in ("interleaved_1f1b", "looped_bfs") else None
    expected = _expected_rejection(name, p, m, num_virtual)
    if expected:
        with pytest.raises(ScheduleError, match=expected):
            build_schedule(name, num_ranks=p, num_microbatches=m, num_virtual=num_virtual)
        return
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_virtual=num_virtual)
    validate(schedule)
    stages_per_rank = {"zb_v": 2, "dualpipev": 2, "interleaved_1f1b": v, "looped_bfs": v, "chimera": 2,
                       "dualpipe": 2}.get(name, 1)
    assert schedule.name == name
    assert (schedule.num_ranks, schedule.num_microbatches) == (p, m)
    assert schedule.num_stages == p * stages_per_rank
    assert (schedule.staleness is not None) == (name in ("pipedream", "pipedream_2bw", "pipemare"))
    assert schedule.split_backward == (name.startswith("zb_") or name.startswith("dualpipe"))
    assert schedule.full_backward == name.startswith("dualpipe")  # the executor runs their B then own W as one
    assert all(len(schedule.stages_of_rank(r)) == stages_per_rank for r in range(p))
    kinds = 3 if schedule.split_backward else 2
    assert sum(map(len, schedule.actions)) == kinds * schedule.parts * m  # each microbatch visits one replica


def _torch_dualpipev(p: int, m: int) -> list[tuple[list[str], tuple[int, ...]]]:
    """torch.distributed.pipelining's ScheduleDualPipeV order per rank, as (actions, overlapped pairs).

    Its FULL_BACKWARD is written as B then W, and each OVERLAP_F_B as its two sub-actions.
    """
    import types
    from torch.distributed.pipelining import schedules as ts
    spelled = {ts.FORWARD: ("F",), ts.FULL_BACKWARD: ("B", "W"), ts.BACKWARD_INPUT: ("B",),
               ts.BACKWARD_WEIGHT: ("W",)}
    rows = []
    for rank in range(p):
        row, pairs = [], []
        order = ts.ScheduleDualPipeV._calculate_single_rank_operations(
            types.SimpleNamespace(pp_group_size=p, _n_microbatches=m), rank)
        for action in order:
            if action.computation_type == ts.OVERLAP_F_B:
                pairs.append(len(row))
            for sub in action.sub_actions or (action,):
                row += [f"{sub.stage_index}{k}{sub.microbatch_index}" for k in spelled[sub.computation_type]]
        rows.append((row, tuple(pairs)))
    return rows


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_dualpipev_equals_torchs_order_and_pairs(p):
    for m in range(2 * p, 2 * p + 7):
        schedule = build_schedule("dualpipev", num_ranks=p, num_microbatches=m)
        for rank, (row, pairs) in enumerate(_torch_dualpipev(p, m)):
            assert [str(a) for a in schedule.actions[rank]] == row, (p, m, rank)
            assert schedule.overlapped[rank] == pairs, (p, m, rank)


def test_overlapped_pairs_are_checked():
    row = build_schedule("dualpipev", num_ranks=1, num_microbatches=2)
    with pytest.raises(ScheduleError, match="not a forward followed by a backward"):
        Schedule(name="x", num_ranks=1, num_stages=2, num_microbatches=2, stage_to_rank=(0, 0),
                 actions=row.actions, split_backward=True, overlapped=((0,),))
    with pytest.raises(ScheduleError, match="a pair joins exactly two actions"):
        Schedule.from_csv("0F0&1B0&1W0\n")


def test_stage_placement():
    assert interleaved_1f1b(num_ranks=3, num_microbatches=3, num_virtual=2).stage_to_rank == (0, 1, 2, 0, 1, 2)
    assert looped_bfs(num_ranks=3, num_microbatches=1, num_virtual=2).stage_to_rank == (0, 1, 2, 0, 1, 2)
    assert zb_v(num_ranks=3, num_microbatches=1).stage_to_rank == (0, 1, 2, 2, 1, 0)
    for generate in (naive, gpipe, one_f_one_b, zb_h1, zb_h2):
        assert generate(num_ranks=3, num_microbatches=3).stage_to_rank == (0, 1, 2)


def test_one_f_one_b_warmup_and_naive_has_no_overlap():
    schedule = one_f_one_b(num_ranks=4, num_microbatches=6)
    for rank, row in enumerate(schedule.actions):
        first_backward = next(i for i, a in enumerate(row) if a.kind is ActionKind.B)
        assert first_backward == 4 - rank  # p - 1 - r warmup forwards, then the steady F
    naive_rows = naive(num_ranks=3, num_microbatches=2).actions
    assert all([str(a)[1:] for a in row] == ["F0", "B0", "F1", "B1"] for row in naive_rows)


def test_one_f_one_b_needs_as_many_microbatches_as_ranks():
    with pytest.raises(ScheduleError, match=r"needs num_microbatches >= 4") as info:
        one_f_one_b(num_ranks=4, num_microbatches=3)
    assert "gpipe" in info.value.fix


def test_interleaved_needs_a_multiple_of_ranks():
    with pytest.raises(ScheduleError, match="multiple of num_ranks") as info:
        interleaved_1f1b(num_ranks=4, num_microbatches=6, num_virtual=2)
    assert "num_microbatches=8" in info.value.fix


@pytest.mark.parametrize(
    ("name", "kwargs", "message", "fix"),
    [
        ("pipedream_3bw", {}, "unknown schedule 'pipedream_3bw'", "naive, gpipe, 1f1b, interleaved_1f1b"),
        ("zb_v", dict(num_virtual=3), "exactly 2 stage", "drop num_virtual"),
        ("1f1b", dict(num_virtual=2), "exactly 1 stage", "interleaved_1f1b or looped_bfs"),
        ("interleaved_1f1b", dict(num_virtual=1), "needs num_virtual >= 2", "num_virtual=2"),
        ("looped_bfs", dict(num_virtual=0), "needs num_virtual >= 1", "num_virtual=1"),
        ("gpipe", dict(num_ranks=0), "num_ranks must be an int >= 1", "num_ranks=1"),
        ("zb_h1", dict(num_microbatches=2.0), "num_microbatches must be an int >= 1", None),
    ],
)
def test_registry_rejects_wrong_combinations_with_a_fix(name, kwargs, message, fix):
    options = dict(num_ranks=4, num_microbatches=8) | kwargs
    with pytest.raises(ScheduleError, match=message) as info:
        build_schedule(name, **options)
    if fix:
        assert fix in info.value.fix


def test_registry_defaults():
    assert build_schedule("zb_v", num_ranks=2, num_microbatches=4, num_virtual=2).num_stages == 4
    assert build_schedule("zb_v", num_ranks=2, num_microbatches=4).num_stages == 4
    assert build_schedule("looped_bfs", num_ranks=2, num_microbatches=4).num_stages == 4  # compile's default too
    assert build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=4).num_stages == 4
    assert build_schedule("gpipe", num_ranks=2, num_microbatches=4, num_virtual=1).num_stages == 2


def test_generators_take_keyword_options_only():
    with pytest.raises(TypeError):
        gpipe(2, 4)  # type: ignore[misc]
    with pytest.raises(TypeError):
        build_schedule("gpipe", 2, 4)  # type: ignore[misc]


def test_dualpipe_rank_order_follows_deepseeks_phases_on_four_ranks():
    # rank 0 of p=4, m=8, worked by hand: half rank 0 of 2, down stage 0 first, up stage 7 second
    # (up microbatches are the odd ones): 1: 2 F; 2: F F; 3: B(split) W F; 4: (F&B) (F&B);
    # 5: B, (F&B); 6: B then split B; 7: W, split B; 8: W
    schedule = build_schedule("dualpipe", num_ranks=4, num_microbatches=8)
    assert schedule.cells(0) == (
        "0F0 0F2 0F4 7F1 7B1 7W1 7F3 0F6&7B3 7W3 7F5&0B0 0W0 7B5 7W5 7F7&0B2 0W2 7B7 7W7 0B4 0W4 0B6 0W6").split()
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.microbatch_replica == (0, 1) * 4


def test_dualpipe_bubble_is_below_1f1bs():
    from autopar.runtime.schedules import StageCosts, simulate
    costs = StageCosts(forward=1.0, backward=1.0, weight=1.0)
    two_way = simulate(build_schedule("dualpipe", num_ranks=4, num_microbatches=8), costs=costs)
    v_shape = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8), costs=costs)
    assert two_way.mean_bubble < v_shape.mean_bubble


@pytest.mark.parametrize("p", [2, 4, 6])
def test_dualpipe_runs_dualpipevs_order_on_each_half(p):
    """dualpipe's definition: rank r runs DualPipeV's order for its half rank min(r, p - 1 - r) of p / 2, with
    half the microbatches per direction (down even, up odd); its first chunk is the direction whose input end
    is nearer (down on the first half of the ranks, up on the second). DualPipeV is torch's order (above)."""
    for per_direction in range(p, p + 4):
        two = build_schedule("dualpipe", num_ranks=p, num_microbatches=2 * per_direction)
        v = build_schedule("dualpipev", num_ranks=p // 2, num_microbatches=per_direction)
        for r in range(p):
            h = min(r, p - 1 - r)
            down, up = r, 2 * p - 1 - r
            first, second = (down, up) if r < p // 2 else (up, down)
            stage = {h: first, p - 1 - h: second}  # DualPipeV's rank h runs stages h and p - 1 - h
            expected = tuple(Action(stage[a.stage], a.kind, 2 * a.microbatch + (stage[a.stage] >= p))
                             for a in v.actions[h])
            assert two.actions[r] == expected, (p, per_direction, r)
            assert two.overlapped[r] == v.overlapped[h], (p, per_direction, r)


def test_fewer_microbatches_than_twice_the_ranks_drop_the_rest_and_the_pairs_they_break():
    """DualPipeV on 2 ranks with 3 microbatches: the order for 4 without microbatch 3. Rank 0's pairs
    0F3&3B1 and 3F3&0B1 lose their forward: 3B1 and 0B1 stay, apart; 3F2&0B0 stays a pair."""
    schedule = build_schedule("dualpipev", num_ranks=2, num_microbatches=3)
    assert schedule.cells(0) == "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 3F2&0B0 0W0 3B2 3W2 0B1 0W1 0B2 0W2".split()
    assert schedule.cells(1) == "1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2&1B0 1W0 2B1 2W1 1B1 1W1 2B2 2W2 1B2 1W2".split()
    # below 2p the order for 2p is cut; DualPipe with an odd count cuts the order for one more (the last up one)
    cases = [("dualpipev", 3, m, 6) for m in range(1, 6)] + [("dualpipe", 4, m, 8) for m in range(1, 8)] + [
        ("dualpipe", 4, 9, 10), ("dualpipe", 4, 11, 12)]
    for name, p, m, whole in cases:
        full = build_schedule(name, num_ranks=p, num_microbatches=whole)
        cut = build_schedule(name, num_ranks=p, num_microbatches=m)
        for r in range(p):
            kept = [i for i, a in enumerate(full.actions[r]) if a.microbatch < m]
            assert cut.actions[r] == tuple(full.actions[r][i] for i in kept), (name, m, r)
            assert cut.overlapped[r] == tuple(kept.index(i) for i in full.overlapped[r]
                                              if i in kept and i + 1 in kept), (name, m, r)
