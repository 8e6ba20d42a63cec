"""The search's answer is the simulator's best, and its reasons and warnings use the figures of its table.

Toy clusters, a 4-block GPT: every fitting candidate is simulated here to check the best-first search.
No processes, no timing.
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from autopar.errors import AutoparError
from autopar.models import build_model, lm_loss
from autopar.planner import Cluster, CostModel, Device, Link, get_cluster, profile_model, search
from autopar.planner.reasons import batch_warnings, explain, format_table
from autopar.planner.candidates import SearchSpace, structures
from autopar.planner.search import TIE, _ranked, _structure_bound, constraint
from autopar.planner.stage_cuts import memory_fits


def toy_cluster(*, per_node: int = 4, nodes: int = 2, memory_gb: float = 1.0) -> Cluster:
    device = Device(name="toy", flops={"fp32": 1e9}, efficiency=1.0, memory_gb=memory_gb, memory_bandwidth=1e9,
                    op_overhead_s=1e-5)
    return Cluster(name="toy", nodes=nodes, devices_per_node=per_node, device=device, memory_reserve=0.0,
                   intra=Link(latency_s=1e-5, bandwidth=1e9), inter=Link(latency_s=1e-4, bandwidth=1e8))


def _profile(batch: int, num_layers: int = 4):
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=num_layers, seq_len=16)
    tokens = torch.randint(0, 128, (batch, 16), generator=torch.Generator().manual_seed(0))
    return profile_model(model, example_inputs=(tokens,), loss_fn=lm_loss, example_target=tokens, tp_degrees=(1, 2))


@pytest.fixture(scope="module")
def profile():
    return _profile(16)


def _every_fitting_candidate_simulated(result, profile, cluster, world):
    """Each candidate of the space (structures x ZeRO x recompute, cuts placed as the search places them)."""
    space, out = SearchSpace(), []
    model = CostModel(profile, cluster)
    for s in structures(world, profile, cluster, space, []):
        for zero in (space.zero_stages if s.dp > 1 else (0,)):
            for rc in space.recompute:
                c = replace(s, zero_stage=zero, recompute=rc)
                if constraint(c):
                    continue
                try:
                    e = result.evaluate(c)
                    if not e.fits and c.num_stages > 1:
                        e = result.frontier.evaluate(c, fits=memory_fits(c, profile, cluster))
                except AutoparError:
                    continue
                if e.fits:
                    out.append((e, model.estimate(e.candidate, simulate_pipeline=True)))
    return out


def test_the_choice_is_the_simulators_best_where_the_closed_form_disagrees(profile):
    cluster, world = toy_cluster(), 8
    result = search(profile, cluster, world=world)
    pairs = _every_fitting_candidate_simulated(result, profile, cluster, world)
    assert len(pairs) > 100
    closed_best = min(pairs, key=lambda p: p[0].step_time)[0].candidate
    simulated = _ranked([sim for _, sim in pairs])
    key = lambda e: replace(e.candidate, cuts=())  # noqa: E731
    assert key(simulated[0]) != replace(closed_best, cuts=())  # the two orders disagree on the winner
    assert key(result.best) == key(simulated[0])
    assert result.best.step_time == pytest.approx(simulated[0].step_time, rel=1e-12)
    rows = result.exact_rows
    assert rows >= SearchSpace().exact_top
    assert [key(e) for e in result.ranked[:rows]] == [key(e) for e in simulated[:rows]]
    assert result.num_simulated < len(pairs) / 4  # best-first: most candidates never simulated
    model = result.cost_model
    for closed, sim in pairs:  # the closed form is a lower bound of the simulated figure, candidate by candidate
        assert closed.step_time <= sim.step_time * (1 + 1e-12)
        structure = replace(sim.candidate, zero_stage=0, recompute="none", cuts=())  # and so is its structure's
        assert _structure_bound(model, structure, SearchSpace().zero_stages) <= sim.step_time * (1 + 1e-12)


def test_the_closed_form_bounds_the_simulation_with_ranks_sharing_cores(profile):
    cluster = get_cluster("cpu-2core", world=4)
    result = search(profile, cluster, world=4, space=SearchSpace(exact_top=10**6))  # everything simulated
    assert result.num_simulated == len([e for e in result.estimates.values() if e.fits]) > 100
    for key, closed in result.estimates.items():
        if key in result.simulated:
            assert closed.step_time <= result.simulated[key].step_time * (1 + 1e-12)


_TIMED = re.compile(r"(dp=\d+ pp=\d+ tp=\d+ m=\d+ \S+ ZeRO-\d rc=\w+),? (?:would take|takes|is slower:) ([0-9.e+-]+) s")


@pytest.mark.parametrize("world, memory_gb", [(8, 1.0), (4, 0.0008)])
def test_every_reason_reads_the_simulated_figures_of_the_table(profile, world, memory_gb):
    cluster = toy_cluster(memory_gb=memory_gb)
    result = search(profile, cluster, world=world)
    lines = explain(result)
    best = result.best
    assert lines[0].startswith(f"chosen: {best.candidate.label()}: {best.step_time:.4g} s/step simulated")
    by_label = {e.candidate.label(): e for e in result.simulated.values()}
    named = 0
    for line in lines[1:-1]:
        for label, seconds in _TIMED.findall(line):
            named += 1
            alt = by_label[label]  # every alternative named was simulated
            assert f"{alt.step_time:.4g}" == seconds
            if alt.fits:  # a fitting alternative is never faster than the choice beyond the tie
                assert alt.step_time * (1 + TIE) >= best.step_time
            else:
                assert "needs" in line
            if alt.step_time < best.step_time:
                assert "but" in line or "within 1% of the choice, which is simpler" in line
    assert named >= 3
    table = format_table(result)
    for row in table.splitlines()[2:2 + min(10, result.exact_rows)]:  # the table's figures are the same ones
        assert row.split()[-4] == f"{result.ranked[int(row.split()[0]) - 1].step_time:.4g}"
    assert f"the search simulated {result.num_simulated} candidates" in table
    assert len(table.splitlines()) >= 3 + min(10, result.exact_rows)


def test_a_small_batch_on_a_deep_pipeline_is_warned_with_the_batch_that_fills_it():
    profile = _profile(2, num_layers=8)
    cluster = toy_cluster(per_node=1, nodes=8)
    result = search(profile, cluster, world=8, space=SearchSpace(pp=(8,)))
    best = result.best
    assert best.parts["bubble"] / best.step_time > 1 / 3
    (warning, *rest) = batch_warnings(result)
    assert warning.startswith("warning: the global batch of 2 cannot fill the pipeline")
    batch, m = (int(x) for x in re.search(r"a global batch of (\d+) \((\d+) microbatches", warning).groups())
    c = replace(best.candidate, num_microbatches=m)
    bigger = CostModel(replace(profile, global_batch=batch), cluster).estimate(c, simulate_pipeline=True)
    assert bigger.parts["bubble"] / bigger.step_time <= 1 / 3
    again = search(replace(profile, global_batch=batch), cluster, world=8, space=SearchSpace(pp=(8,),
                                                                                          num_microbatches=(m,)))
    assert not any("cannot fill the pipeline" in w for w in batch_warnings(again))


def test_a_batch_that_caps_data_parallelism_is_warned():
    profile = _profile(2, num_layers=2)
    result = search(profile, toy_cluster(per_node=1, nodes=4, memory_gb=1.0), world=4,
                    space=SearchSpace(tp=(1,), pp=(1, 2)))
    assert result.best.candidate.dp == 2  # the batch of 2 allows no more, and the plan is data-parallel
    (warning,) = batch_warnings(result)
    assert "dp=2 is the most it divides among the meshes of 4 ranks" in warning
    assert warning.endswith("a global batch of 4 would allow dp=4")
    roomy = search(replace(profile, global_batch=4), toy_cluster(per_node=1, nodes=4), world=4,
                   space=SearchSpace(tp=(1,), pp=(1, 2)))
    assert not any("data-parallel" in w for w in batch_warnings(roomy))


def test_the_cli_plans_for_the_input_shape_given_and_prints_the_warning(tmp_path, capsys):
    from autopar.cli import main

    path = tmp_path / "toy.json"
    path.write_text(toy_cluster(per_node=1, nodes=4).model_dump_json())
    target = "autopar.models.examples:gpt_tiny"  # returns its own batch of 8 x 32 tokens
    assert main(["plan", target, "--cluster", str(path), "--mesh", "pp=4", "--input-shape", "1x16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("planned for inputs 1x16 int64 (global batch 1)")
    assert "batch 1 = dp 1 x 1 microbatches x 1" in out
    assert "warning: the global batch of 1 cannot fill the pipeline" in out
    assert "a global batch of 2 (2 microbatches of 1 per replica, dp=1) would bring it to" in out
    assert main(["plan", target, "--cluster", str(path), "--world", "2", "--json"]) == 0
    assert '"inputs": [\n    [\n      8,\n      32' in capsys.readouterr().out
    assert main(["plan", target, "--cluster", str(path), "--input-shape", "4xq"]) == 2
    assert "cannot read --input-shape '4xq'" in capsys.readouterr().err


def test_microbatch_counts_reach_one_sample_per_microbatch_at_every_pp(profile):
    """Every count that divides a replica's batch is a structure at every pp (the schedules refuse the ones
    they cannot run), one sample per microbatch included: nothing caps them at a multiple of pp."""
    found = list(structures(8, profile, toy_cluster(), SearchSpace(), []))
    for pp in (1, 2, 4, 8):
        for dp in {s.dp for s in found if s.pp == pp}:
            local = profile.global_batch // dp
            counts = {s.num_microbatches for s in found if s.pp == pp and s.dp == dp}
            assert counts == {d for d in range(1, local + 1) if local % d == 0}, (pp, dp, counts)


def test_a_deep_pipeline_gets_one_sample_per_microbatch_when_the_bubble_dominates():
    """The issue's case: pp=16 with 144 samples per replica; 1F1B's bubble (p-1)/(m+p-1) falls with every
    microbatch, so with no per-op cost the fastest is one sample per microbatch (m=144 > 8 x pp)."""
    profile = _profile(144, num_layers=16)
    device = Device(name="toy", flops={"fp32": 1e9}, efficiency=1.0, memory_gb=100.0, memory_bandwidth=1e12,
                    op_overhead_s=0.0)
    cluster = Cluster(name="toy", nodes=16, devices_per_node=1, device=device, memory_reserve=0.0,
                      intra=Link(latency_s=1e-9, bandwidth=1e12), inter=Link(latency_s=1e-9, bandwidth=1e12))
    best = search(profile, cluster, world=16, space=SearchSpace(pp=(16,), schedules=(("1f1b", 1),),
                                                               zero_stages=(0,), recompute=("none",))).best
    assert best.candidate.num_microbatches == 144


def test_interleaving_is_searched_at_every_depth_that_divides_the_blocks():
    """Interleaved 1F1B at 2 stages per rank and every count up to 8 that gives each stage as many blocks."""
    profile = _profile(16, num_layers=12)
    found = {(s.pp, s.num_virtual) for s in structures(4, profile, toy_cluster(per_node=4, nodes=1),
                                                        SearchSpace(tp=(1,)), []) if s.schedule == "interleaved_1f1b"}
    assert found == {(2, 2), (2, 3), (2, 6), (4, 2), (4, 3)}
    pinned = {s.num_virtual for s in structures(4, profile, toy_cluster(per_node=4, nodes=1),
                                                 SearchSpace(tp=(1,), pp=(2,), virtual=(4,)), [])
              if s.schedule == "interleaved_1f1b"}
    assert pinned == {4}
