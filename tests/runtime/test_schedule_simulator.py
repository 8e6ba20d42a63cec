"""The simulator against the published bubble and memory figures, and its own invariants.

Unless a test says otherwise, stages are uniform and transfers free (``p2p = 0``), the setting in which
the papers state their formulas; under it the simulator reproduces them exactly, so we assert to 1e-9.

- GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021): bubble ``(p - 1) / (m + p - 1)`` for any
  forward and backward cost, since every rank idles ``(p - 1)(F + B)`` of ``(m + p - 1)(F + B)``.
- Interleaved 1F1B and looped BFS with ``v`` stages per rank: the model is cut ``v`` times finer, so each
  stage costs ``F / v`` and ``B / v``. Megatron's bubble time is ``(p - 1)(F + B) / v`` against
  ``m (F + B)`` of work, i.e. a bubble fraction of the step of ``(p - 1) / (v m + p - 1)``; we assert
  that (for looped BFS when ``m >= p``, else it idles between its local stages).
- Zero bubble (Qi et al. 2024), with F = B = W = 1 per stage: 1F1B's full backward then costs
  ``B + W = 2`` and its bubble time is ``(p - 1)(F + B + W) = 3 (p - 1)``. ZB-H1's is ``(p - 1)(F + B - W)
  = p - 1``, exactly a third (for ``m >= p``). As fractions of their (different) step times the ratio is
  not exactly 1/3, so we assert the bubble times. ZB-H2 and ZB-V leave only the pipeline fill
  (``(p - 1)`` forwards of one stage: nothing can run on the last rank before the first microbatch
  reaches it), so their synchronous bubble is ``(p - 1) / (3m + p - 1)`` and ``(p - 1) / (6m + p - 1)``
  (one V stage has half a rank's layers). That is 1/13 (ZB-V) to 1/7 (ZB-H2) at ``m = 2p``, not below 5%,
  because a step that ends with a flush cannot hide the fill; the paper's "zero" is the steady state
  with no flush between steps (its post-validated optimizer step), which ``steady_bubble`` measures and
  which is exactly 0 for ``m >= 2p - 1``.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ScheduleError
from autopar.runtime.schedules import (
    Action,
    Schedule,
    StageCosts,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    naive,
    one_f_one_b,
    schedule_names,
    simulate,
    zb_h1,
    zb_h2,
    zb_v,
)
from autopar.runtime.schedules.deps import dependencies

UNIT = StageCosts(forward=1, backward=1, weight=1)
SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


def _assert_all_close(values, expected, tol=1e-9):
    assert all(abs(v - expected) <= tol for v in values), (values, expected)


@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize(("forward", "backward"), [(1.0, 1.0), (1.0, 2.0), (1.3, 0.7)])
def test_gpipe_and_one_f_one_b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m, forward, backward):
    costs = StageCosts(forward=forward, backward=backward, weight=0)
    expected = (p - 1) / (m + p - 1)
    schedules = [gpipe(num_ranks=p, num_microbatches=m)] + ([one_f_one_b(num_ranks=p, num_microbatches=m)] if m >= p else [])
    for schedule in schedules:
        result = simulate(schedule, costs=costs)
        _assert_all_close(result.bubble_fraction, expected)
        assert result.mean_bubble == pytest.approx(expected, abs=1e-9)
        assert result.step_time == pytest.approx((m + p - 1) * (forward + backward), abs=1e-9)


@pytest.mark.parametrize(("p", "m", "v"), [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p) for v in (2, 3, 4)])
def test_interleaved_and_looped_bubble_shrinks_by_v(p, m, v):
    costs = StageCosts(forward=1.0 / v, backward=1.0 / v, weight=0)
    expected = (p - 1) / (v * m + p - 1)
    for generate in (interleaved_1f1b, looped_bfs):
        result = simulate(generate(num_ranks=p, num_microbatches=m, num_virtual=v), costs=costs)
        _assert_all_close(result.bubble_fraction, expected)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m >= p])
def test_zb_h1_bubble_is_a_third_of_one_f_one_b(p, m):
    one_f_one_b_result = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), costs=UNIT)
    zb_result = simulate(zb_h1(num_ranks=p, num_microbatches=m), costs=UNIT)
    work = 3 * m  # F + B + W per microbatch on every rank, in both
    assert one_f_one_b_result.step_time - work == pytest.approx(3 * (p - 1), abs=1e-9)
    assert zb_result.step_time - work == pytest.approx(p - 1, abs=1e-9)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (1, 2, 3, 4, 6) for m in (2 * p - 1, 2 * p, 3 * p + 1, 16)])
def test_zb_h2_and_zb_v_leave_only_the_pipeline_fill(p, m):
    h2 = simulate(zb_h2(num_ranks=p, num_microbatches=m), costs=UNIT)
    assert h2.step_time == pytest.approx(3 * m + p - 1, abs=1e-9)
    _assert_all_close(h2.bubble_fraction, (p - 1) / (3 * m + p - 1))
    v = simulate(zb_v(num_ranks=p, num_microbatches=m), costs=UNIT)  # unit costs per V stage
    assert v.step_time == pytest.approx(6 * m + p - 1, abs=1e-9)
    _assert_all_close(v.bubble_fraction, (p - 1) / (6 * m + p - 1))
    for result in (h2, v):
        assert result.steady_bubble == pytest.approx(0.0, abs=1e-9)
    if m >= 2 * p:
        assert h2.mean_bubble < 1 / 7 and v.mean_bubble < 1 / 13


def test_only_the_zero_bubble_schedules_remove_the_steady_bubble():
    p, m = 4, 8
    steady = {name: simulate(build_schedule(name, num_ranks=p, num_microbatches=m,
                                            num_virtual=2 if name == "interleaved_1f1b" else None),
                             costs=UNIT).steady_bubble for name in schedule_names()}
    assert steady["zb_h2"] == pytest.approx(0, abs=1e-9) and steady["zb_v"] == pytest.approx(0, abs=1e-9)
    for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b"):
        assert steady[name] > 0.05  # rank 0 waits for its first backward inside the step


def test_naive_keeps_one_rank_busy_at_a_time():
    result = simulate(naive(num_ranks=4, num_microbatches=3), costs=StageCosts(forward=1, backward=2, weight=0))
    assert result.step_time == pytest.approx(4 * 3 * 3)
    _assert_all_close(result.bubble_fraction, 0.75)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_peak_activations(p, m):
    def peak(name):
        return simulate(build_schedule(name, num_ranks=p, num_microbatches=m), costs=UNIT).peak_activations

    assert peak("1f1b") == tuple(p - r for r in range(p))  # rank 0 holds p
    assert peak("gpipe") == (m,) * p
    assert peak("naive") == (1,) * p
    assert max(peak("zb_h1")) == p  # 1F1B's peak
    assert max(peak("zb_h2")) == min(2 * p - 1, m)
    assert max(peak("zb_v")) == 2 * p  # stage-microbatches of half a rank's layers: p microbatches


def test_p2p_is_paid_only_across_ranks_and_costs_per_stage():
    costs = StageCosts(forward=[1, 2], backward=[3, 4], weight=[0.5, 0.25], p2p=10)
    result = simulate(gpipe(num_ranks=2, num_microbatches=1), costs=costs)
    assert [tuple(e) for e in result.events[0]] == [(Action.parse("0F0"), 0, 1), (Action.parse("0B0"), 27.25, 30.75)]
    assert [tuple(e) for e in result.events[1]] == [(Action.parse("1F0"), 11, 13), (Action.parse("1B0"), 13, 17.25)]
    assert result.step_time == 30.75
    assert result.per_rank_busy == (4.5, 6.25)
    assert result.weight_versions == 1
    split = simulate(zb_h1(num_ranks=1, num_microbatches=1), costs=StageCosts(forward=1, backward=3, weight=5))
    assert [e.end - e.start for e in split.events[0]] == [1, 3, 5]  # B and W charged separately


def test_costs_are_checked():
    with pytest.raises(ScheduleError, match="StageCosts.forward has 3 entries for 2 stages"):
        simulate(gpipe(num_ranks=2, num_microbatches=1), costs=StageCosts(forward=[1, 1, 1], backward=1, weight=0))
    with pytest.raises(ScheduleError, match="StageCosts.backward must be a number >= 0"):
        StageCosts(forward=1, backward=-1, weight=0)
    with pytest.raises(ScheduleError, match="StageCosts.weight must be a number >= 0"):
        StageCosts(forward=1, backward=1, weight=[])
    with pytest.raises(ScheduleError, match="p2p must be >= 0"):
        StageCosts(forward=1, backward=1, weight=0, p2p=-1)
    with pytest.raises(TypeError):
        StageCosts(1, 1, 0)  # type: ignore[misc]


def test_simulate_validates_first():
    broken = Schedule.from_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(broken, costs=UNIT)


@given(
    name=st.sampled_from(schedule_names()),
    p=st.integers(1, 5),
    m=st.integers(1, 10),
    costs=st.tuples(*(st.floats(0.0, 5.0) for _ in range(4))),
)
@settings(max_examples=80, deadline=None)
def test_events_respect_order_dependencies_and_costs(name, p, m, costs):
    if name in ("1f1b", "pipedream_2bw"):
        m = max(m, p)
    if name == "interleaved_1f1b":
        m = p * max(1, m // p)
    if name == "dualpipe":  # an even number of ranks (DeepSeek's condition)
        p += p % 2
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m,
                              num_virtual=2 if name in ("interleaved_1f1b", "looped_bfs") else None)
    stage_costs = StageCosts(forward=costs[0], backward=costs[1], weight=costs[2], p2p=costs[3])
    result = simulate(schedule, costs=stage_costs)
    end = {e.action: (rank, e.end) for rank, row in enumerate(result.events) for e in row}
    for rank, row in enumerate(result.events):
        assert [e.action for e in row] == list(schedule.actions[rank])
        for before, after in zip(row, row[1:]):
            assert after.start >= before.end
        for event in row:
            duration = stage_costs.cost(event.action, num_stages=schedule.num_stages,
                                        split_backward=schedule.split_backward)
            assert event.end - event.start == pytest.approx(duration)
            for dep in dependencies(event.action, num_stages=schedule.num_stages,
                                    num_replicas=schedule.num_replicas):
                dep_rank, dep_end = end[dep]
                assert event.start >= dep_end + (stage_costs.p2p if dep_rank != rank else 0) - 1e-9
    assert result.step_time == max((row[-1].end for row in result.events if row), default=0)
    assert all(-1e-9 <= b <= 1 for b in result.bubble_fraction)
    assert result.steady_step_time <= result.step_time + 1e-9
    assert dataclasses.is_dataclass(result)


def test_costs_are_frozen_data():
    costs = StageCosts(forward=[1, 2], backward=1, weight=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        costs.p2p = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        simulate(gpipe(num_ranks=2, num_microbatches=2), costs=costs).step_time = 0.0
    assert hash(costs) == hash(StageCosts(forward=(1, 2), backward=1, weight=0))


def test_results_compare_by_what_was_measured_not_by_the_schedule_they_came_from():
    schedule = gpipe(num_ranks=2, num_microbatches=2)
    result = simulate(schedule, costs=UNIT)
    assert result == simulate(dataclasses.replace(schedule, name="renamed"), costs=UNIT)
    per_stage = StageCosts(forward=[1, 1], backward=[1, 1], weight=[1, 1])
    assert result == simulate(schedule, costs=per_stage, durations={})  # other costs and durations, same times
    assert "schedule=" not in repr(result) and "costs=" not in repr(result) and "durations=" not in repr(result)


def test_the_peak_counts_activations_held_after_a_release():
    """One stage on one rank: F0 B0 F1 F2 B1 B2 holds 1, 0, 1, 2, 1, 0 activations: the peak, 2, comes after B0."""
    assert simulate(Schedule.from_csv("0F0,0B0,0F1,0F2,0B1,0B2\n"), costs=UNIT).peak_activations == (2,)


def test_a_bool_is_not_a_cost():
    with pytest.raises(ScheduleError, match="StageCosts.forward must be a number >= 0"):
        StageCosts(forward=True, backward=1, weight=0)


def test_a_forward_only_schedule_holds_no_activations_and_a_step_of_no_time_has_no_bubble():
    assert simulate(forward_only(gpipe(num_ranks=2, num_microbatches=2)), costs=UNIT).peak_activations == (0, 0)
    idle = simulate(gpipe(num_ranks=2, num_microbatches=2), costs=StageCosts(forward=0, backward=0, weight=0))
    assert idle.step_time == 0.0 and idle.bubble_fraction == (0.0, 0.0) and idle.mean_bubble == 0.0


def test_the_steady_bubble_of_gpipe_on_two_ranks_by_hand_and_the_bubble_has_no_unit():
    """F = 1, B = 2 (B + W), m = 2: rank 0 runs F0 F1 (0-2), B1 (5-7), B0 (7-9); rank 1 F0 F1 (1-3), B1 B0
    (3-7): spans 9 and 6, 6 busy each, so back to back a step takes 9 and each rank idles 1/3 of it."""
    schedule = gpipe(num_ranks=2, num_microbatches=2)
    result = simulate(schedule, costs=UNIT)
    assert result.steady_step_time == 9.0 and result.steady_bubble == pytest.approx(1 / 3)
    tenth = simulate(schedule, costs=StageCosts(forward=0.1, backward=0.1, weight=0.1))  # a step under 1
    assert tenth.bubble_fraction == pytest.approx(result.bubble_fraction) and tenth.mean_bubble > 0
