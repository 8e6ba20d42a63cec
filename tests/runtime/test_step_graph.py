"""One model of the step, two evaluations: the simulator (event by event) and the step graph (networkx).

The simulator's step time must equal the longest path of runtime/schedules/step_graph.py on any
schedule, costs and transfer time (hypothesis draws them), and the critical path must be a path
of actions and transfers the simulator timed back to back. Golden paths are derived by hand.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.runtime.schedules import StageCosts, build_schedule, simulate
from autopar.runtime.schedules.registry import family, schedule_names
from autopar.runtime.schedules.step_graph import END, CriticalPath, PathStep, critical_path, step_graph, wait_cycle
from autopar.runtime.execution.trace import (action_durations, bubble_report, measured_critical_path, replay,
                                             transfer_latency)
from schedule_runners import CRITICAL_PATH_CASES, results

UNIT = StageCosts(forward=1, backward=1, weight=1)


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(schedule_names()))
    row = family(name)
    p = draw(st.sampled_from((2, 4)) if name in ("dualpipe",) else st.integers(2, 5))
    v = row.stages_per_rank if row.fixed else draw(st.integers(2, 3))
    m = draw(st.integers(1, 2 * p + 2))
    if name in ("1f1b", "pipedream_2bw"):
        m = max(m, p)
    if name == "interleaved_1f1b":
        m = p * draw(st.integers(1, 2))
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_virtual=v)
    quarter = st.integers(1, 16).map(lambda k: k / 4)
    per_stage = st.lists(quarter, min_size=schedule.num_stages, max_size=schedule.num_stages)
    costs = StageCosts(forward=draw(per_stage), backward=draw(per_stage), weight=draw(per_stage),
                       p2p=draw(st.sampled_from((0.0, 0.25, 1.5))))
    return schedule, costs


def _assert_path_is_tight(schedule, costs, sim, path):
    """Each action of the path starts, in the simulation, when the path says (its predecessor's end plus the
    transfer), the path follows the graph's edges, and its pieces add up to the step."""
    start = {str(e.action): e.start for row in sim.events for e in row}
    graph = step_graph(schedule, costs=costs)
    actions = [s for s in path.steps if s.kind != "transfer"]
    assert actions[0].start == 0.0 and not any(True for _ in graph.predecessors(_action(schedule, actions[0].label)))
    for step in actions:
        assert start[step.label] == pytest.approx(step.start, abs=1e-9), step
    for a, b in zip(actions, actions[1:]):
        assert graph.has_edge(_action(schedule, a.label), _action(schedule, b.label)), (a, b)
    assert sum(s.seconds for s in path.steps) == pytest.approx(sim.step_time, abs=1e-9)


def _action(schedule, label):
    return next(a for row in schedule.actions for a in row if str(a) == label)


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_the_longest_path_is_the_simulated_step(case):
    schedule, costs = case
    sim = simulate(schedule, costs=costs)
    graph = step_graph(schedule, costs=costs)
    assert nx.dag_longest_path_length(graph, weight="weight") == pytest.approx(sim.step_time, abs=1e-9)
    assert sim.critical_path.length == pytest.approx(sim.step_time, abs=1e-9)
    _assert_path_is_tight(schedule, costs, sim, sim.critical_path)


@settings(max_examples=25, deadline=None)
@given(_cases(), st.randoms(use_true_random=False))
def test_measured_durations_give_the_same_equality(case, rng):
    """Per-action durations (a measured step's replay) instead of per-stage costs."""
    schedule, costs = case
    durations = {a: rng.choice((0.5, 1.0, 1.25, 3.0)) for row in schedule.actions for a in row}
    sim = simulate(schedule, costs=costs, durations=durations)
    path = critical_path(schedule, costs=costs, durations=durations)
    assert path.length == pytest.approx(sim.step_time, abs=1e-9)
    assert all(s.seconds == durations[_action(schedule, s.label)] for s in path.steps if s.kind != "transfer")


def test_1f1b_critical_path_on_4_ranks_by_hand():
    """1F1B, p = 4, m = 8, F = 1, B = 2: microbatch 0 goes down (4 F), the last rank runs its whole list
    (8 F and 8 B) and microbatch 7's gradient comes back up (3 B): 4 + 24 + 6 - 1 = 33 = 3 (m + p - 1)."""
    schedule = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    path = simulate(schedule, costs=StageCosts(forward=1, backward=2, weight=0)).critical_path
    assert path.length == 33
    assert path.actions[:4] == ("0F0", "1F0", "2F0", "3F0")
    assert path.actions[3:19] == tuple(str(a) for a in schedule.actions[3])
    assert path.actions[19:] == ("2B7", "1B7", "0B7")
    assert path.by_kind() == {"F": 11, "B": 22} and path.by_rank() == {0: 3, 1: 3, 2: 3, 3: 24}


def test_zb_v_critical_path_on_4_ranks_by_hand():
    """ZB-V, p = 4, m = 8, F = B = W = 1: rank 3 holds both arms of the V's turn (stages 3 and 4) and, once
    microbatch 0 is down the first three ranks, never idles: the path is 0F0 1F0 2F0 then rank 3's whole
    list, 3 + 6 m = 51 (the registry's Max(6m + p - 1, 4m + 4p - 2))."""
    schedule = build_schedule("zb_v", num_ranks=4, num_microbatches=8)
    sim = simulate(schedule, costs=UNIT)
    path = sim.critical_path
    assert sim.step_time == path.length == 51
    assert path.actions == ("0F0", "1F0", "2F0", *(str(a) for a in schedule.actions[3]))
    assert path.by_kind() == {"F": 3 + 16, "B": 16, "W": 16} and path.by_rank() == {0: 1, 1: 1, 2: 1, 3: 48}


def test_the_graph_ends_at_every_rank_last_action_and_marks_transfers():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    graph = step_graph(schedule, costs=StageCosts(forward=1, backward=1, weight=1, p2p=0.5))
    assert sorted(str(u) for u in graph.predecessors(END)) == ["0B1", "1B1"]
    first, second = (_action(schedule, x) for x in ("0F0", "1F0"))
    assert graph.edges[first, second]["kinds"] == {"data"} and graph.edges[first, second]["transfer"] == 0.5
    own = (_action(schedule, "1F0"), _action(schedule, "1B0"))
    assert graph.edges[own]["kinds"] == {"order", "data"} and graph.edges[own]["transfer"] == 0.0


@pytest.mark.dist
@pytest.mark.parametrize("case", CRITICAL_PATH_CASES, ids=lambda c: dict(c.options)["schedule"])
def test_a_measured_step_gives_its_own_critical_path(case):
    """A real 2-rank pp=2 run (1F1B, ZB-V): each step's events give the step graph with the measured durations,
    and its critical path is made of the run's own action times and its transfer latency, as long as the
    replayed step (runtime/execution/trace.py replay)."""
    result = results(case.world_size)[case]
    assert "error" not in result, result.get("traceback", result.get("error"))
    schedule = result["schedule"]
    assert schedule.name == dict(case.options)["schedule"] and schedule.num_ranks == 2
    for events in result["steps"]:
        durations, latency = action_durations(events), transfer_latency(schedule, events)
        path = measured_critical_path(schedule, events)
        assert path.length == pytest.approx(replay(schedule, events).step_time, rel=1e-12)
        # (which ranks the path visits depends on the measured times: under load one rank's own chain can be
        # the longest, so only the path's validity and length are asserted, never its ranks)
        assert path.length > 0 and path.steps
        for step in path.steps:
            expected = latency if step.kind == "transfer" else durations[_action(schedule, step.label)]
            assert step.seconds == pytest.approx(expected, rel=1e-12), step
        graph = step_graph(schedule)
        actions = [_action(schedule, a) for a in path.actions]
        assert all(graph.has_edge(a, b) for a, b in zip(actions, actions[1:]))
        assert graph.has_edge(actions[-1], END)  # it ends with the last action of a rank
        assert f"critical path {path.length:.4g} s" in bubble_report(schedule, events)


def test_the_summary_line_of_a_path_by_hand():
    """1F1B, p = 4, m = 8, F = 1, B = 2 (the path above): 22 actions, the first and last ``show`` printed."""
    path = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8),
                    costs=StageCosts(forward=1, backward=2, weight=0)).critical_path
    assert path.summary(unit="s") == ("critical path 33 s = F 11 (33%), B 22 (67%): 0F0 1F0 2F0 3F0 3B0 3F1 3B1 3F2 "
                                      "... 6 more ... 3B5 3F6 3B6 3F7 3B7 2B7 1B7 0B7")
    assert path.summary(show=11) == "critical path 33 = F 11 (33%), B 22 (67%): " + " ".join(path.actions)
    assert path.summary(show=10).split(": ")[1].split()[10:13] == ["...", "2", "more"]
    assert CriticalPath(()).summary() == "critical path 0 = nothing: "
    assert CriticalPath((PathStep("0F0", "F", 0, 0.0, 0.0),)).summary() == "critical path 0 = F 0 (0%): 0F0"


def test_a_path_and_its_steps_are_frozen_data():
    path = critical_path(build_schedule("1f1b", num_ranks=2, num_microbatches=2), costs=UNIT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        path.steps = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        path.steps[0].seconds = 0.0
    assert hash(path) == hash(critical_path(build_schedule("1f1b", num_ranks=2, num_microbatches=2), costs=UNIT))


def test_the_structure_alone_weighs_nothing_and_only_edges_between_ranks_carry_a_transfer():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    bare = step_graph(schedule)  # neither costs nor durations: every action 0 s, no transfer
    assert {(d["transfer"], d["weight"]) for _u, _v, d in bare.edges(data=True)} == {(0.0, 0.0)}
    timed = step_graph(schedule, costs=StageCosts(forward=1, backward=2, weight=0, p2p=0.5))
    kept = (_action(schedule, "0F0"), _action(schedule, "0B0"))  # same rank, not adjacent: data alone
    assert timed.edges[kept] == {"kinds": {"data"}, "transfer": 0.0, "weight": 1.0}
    assert [(str(u), d["transfer"], d["weight"]) for u, _v, d in timed.in_edges(END, data=True)] == [
        ("0B1", 0.0, 2.0), ("1B1", 0.0, 2.0)]


def test_a_missing_action_drops_only_its_own_edges():
    """0F1 left out: 0B1 still waits on 1B1's gradient (the validator's count check reports the gap)."""
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    broken = dataclasses.replace(schedule, actions=(tuple(a for a in schedule.actions[0] if str(a) != "0F1"),
                                                    schedule.actions[1]))
    graph = step_graph(broken)
    assert graph.edges[_action(schedule, "1B1"), _action(schedule, "0B1")]["kinds"] == {"data"}


def test_a_schedule_without_a_deadlock_has_no_wait_cycle():
    assert wait_cycle(build_schedule("1f1b", num_ranks=2, num_microbatches=2)) is None
