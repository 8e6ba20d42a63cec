"""The planner with mixture-of-experts models: all-to-all costs, expert memory per rank, the ep search.

Single process, nothing timed: clusters are described. The model is the plain-torch Switch MoE of
autopar.models.moe (2 layers of 4 experts, top-1, hidden 32), as in tests/runtime/test_moe_expert_parallel_dist.py.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.memory import estimate_memory
from autopar.models import build_model, lm_loss
from autopar.models.moe import build_moe, moe_loss
from autopar.ops.moe_ops import moe_exchange_nodes
from autopar.planner import Candidate, Cluster, CostModel, Device, Link, profile_model, search
from autopar.planner.candidates import SearchSpace
from autopar.planner.chunk_time import moe_comm
from autopar.planner.reasons import explain, format_table

FAST = Link(latency_s=1e-5, bandwidth=1e9)
SLOW = Link(latency_s=5e-2, bandwidth=1e6)
SEQ, BATCH, HIDDEN, EXPERTS, TOP_K = 16, 8, 32, 4, 1


def _cluster(*, link: Link = FAST, memory_gb: float = 1.0, per_node: int = 4) -> Cluster:
    device = Device(name="toy", flops={"fp32": 1e9}, efficiency=1.0, memory_gb=memory_gb, memory_bandwidth=1e9,
                    op_overhead_s=1e-5)
    return Cluster(name="toy", devices_per_node=per_node, device=device, intra=link, inter=link, memory_reserve=0.0)


def _model(**overrides):
    torch.manual_seed(0)
    return build_moe("switch", **overrides)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (BATCH, SEQ), generator=g), torch.randint(0, 64, (BATCH, SEQ), generator=g)


@pytest.fixture(scope="module")
def profile():
    x, y = _batch()
    return profile_model(_model(), example_inputs=(x,), loss_fn=moe_loss, example_target=y, tp_degrees=(1, 2))


def _a2a(nbytes: float, n: int, link: Link) -> float:  # by hand: (n-1) alpha + (n-1)/n bytes / beta
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth


def test_profile_finds_each_moe_layer_and_its_routed_bytes(profile):
    layers = profile.moe_layers
    assert [m.path for m in layers] == ["blocks.0.moe", "blocks.1.moe"]
    row_bytes = SEQ * TOP_K * HIDDEN * 4  # one sample: tokens x top-k routed rows of hidden fp32 values
    assert all((m.num_experts, m.top_k, m.dispatch_bytes, m.combine_bytes) == (EXPERTS, TOP_K, row_bytes, row_bytes)
               for m in layers)
    blocks = [c for c in profile.chunks[1] if c.is_block]
    assert [len(c.moe) for c in profile.chunks[1]] == [0, 1, 1, 0]
    assert set(blocks[0].moe[0].expert_params) == {"blocks.0.moe.experts.w_in", "blocks.0.moe.experts.w_out"}


def test_all_to_all_cost_is_the_alpha_beta_formula_and_grows_with_ep_and_tokens(profile):
    chunk = next(c for c in profile.chunks[1] if c.moe)
    rows = SEQ * TOP_K * HIDDEN * 4
    assert moe_comm(chunk, b=4, ep=1, link=FAST) == (0.0, 0.0)
    seen = []
    for ep in (2, 4):
        for b in (1, 4):
            forward, backward = moe_comm(chunk, b=b, ep=ep, link=FAST)
            dispatch = _a2a(rows * b, ep, FAST)  # combine moves the same rows back
            assert forward == pytest.approx(_a2a(8 * EXPERTS, ep, FAST) + 2 * dispatch)  # + the row counts
            assert backward == pytest.approx(2 * dispatch)  # the two conjugates
            seen.append(forward + backward)
    assert seen[0] < seen[1] < seen[3] and seen[0] < seen[2] < seen[3]
    # in an estimate: every layer's all-to-alls per microbatch, over the ep group's link
    model = CostModel(profile, _cluster())
    e = model.estimate(Candidate(4, 1, 1, 2, expert_parallel=2))
    b = BATCH // (4 * 2)
    per_layer = _a2a(8 * EXPERTS, 2, FAST) + 4 * _a2a(rows * b, 2, FAST)
    assert e.parts["ep_comm"] == pytest.approx(2 * 2 * per_layer)  # 2 layers, 2 microbatches
    assert model.estimate(Candidate(4, 1, 1, 2)).parts["ep_comm"] == 0.0


@pytest.mark.parametrize("mesh,zero", [((2, 1, 1), 1), ((2, 1, 2), 1), ((2, 2, 1), 0), ((4, 1, 1), 2)],
                         ids=["dp2", "dp2-tp2", "dp2-pp2", "dp4-zero2"])  # dp4: expert state over edp = 2
def test_experts_count_one_ep_th_per_rank_as_the_memory_calculator_counts_them(profile, mesh, zero):
    from autopar.options import CompileOptions
    from autopar.planner.auto import plan_from_estimate
    from autopar.planner.stage_cuts import weighted_cuts

    dp, pp, tp = mesh
    model = CostModel(profile, _cluster(per_node=8))
    experts = sum(p.numel for c in profile.chunks[1] for p in c.params if p.name in model.experts(1))
    assert experts == 2 * 2 * EXPERTS * HIDDEN * 64  # 2 layers of w_in [E, 32, 64] and w_out [E, 64, 32]
    one, two = (Candidate(dp, pp, tp, pp, "gpipe", zero_stage=zero, expert_parallel=ep) for ep in (1, 2))
    if pp > 1:
        one, two = (replace(c, cuts=tuple(weighted_cuts(model.chunk_costs(c), pp))) for c in (one, two))
    one, two = model.estimate(one), model.estimate(two)
    if pp == 1:  # every expert on the rank: half of their bytes go (tp: each already cut over tp)
        assert one.memory_parts["params"] - two.memory_parts["params"] == 4 * experts // 2 // tp
    # the Plan plan="auto" would lower for it: the memory calculator on its graphs counts the same
    x, y = _batch()
    plan = plan_from_estimate(two, profile, options=CompileOptions())
    result = autopar.plan(_model(), plan.mesh, example_inputs=(x,), loss_fn=moe_loss, example_target=y, plan=plan)
    assert result.plan.expert_parallel == 2
    calc = estimate_memory(result, optimizer="adam")
    rank = max(calc.ranks.values(), key=lambda r: r.params + r.grads + r.optimizer)
    assert (two.memory_parts["params"], two.memory_parts["grads"], two.memory_parts["optimizer"]) == (
        rank.params, rank.grads, rank.optimizer)


def test_a_slow_link_keeps_the_experts_replicated(profile):
    result = search(profile, _cluster(link=SLOW), world=4, space=SearchSpace(pp=(1,), tp=(1,)))
    assert result.best.candidate.expert_parallel == 1
    assert {s.expert_parallel for s in result.frontier.structures} == {1, 2, 4}  # ep divides dp=4 and 4 experts
    line = next(r for r in explain(result) if r.startswith("expert parallel:"))
    assert "ep=2" in line and "is slower" in line


def test_a_memory_tight_cluster_splits_the_experts():
    x, y = _batch()
    big = dict(num_experts=8, ffn=256)  # experts hold most of the weights
    prof = profile_model(_model(**big), example_inputs=(x,), loss_fn=moe_loss, example_target=y, tp_degrees=(1,))
    space = SearchSpace(pp=(1,), tp=(1,), zero_stages=(0,), recompute=("none",))
    model = CostModel(prof, _cluster())
    replicated = model.estimate(Candidate(2, 1, 1, 1))
    split = model.estimate(Candidate(2, 1, 1, 1, expert_parallel=2))
    assert split.memory < replicated.memory
    tight = _cluster(memory_gb=(split.memory + replicated.memory) / 2 / 1e9, per_node=2)
    result = search(prof, tight, world=2, space=space)
    best = result.best
    assert best.candidate.expert_parallel == 2 and best.fits
    line = next(r for r in explain(result) if r.startswith("expert parallel:"))
    assert "ep=2" not in line and "needs" in line and "on its fullest rank" in line  # ep=1, and what it lacks
    assert " ep " in format_table(result).splitlines()[0]
    # plan="auto" carries the choice into the Plan and the lowered graphs
    auto = autopar.plan(_model(**big), {"pp": 1, "tp": 1, "world": 2}, example_inputs=(x,), loss_fn=moe_loss,
                        example_target=y, plan="auto", cluster=tight, zero_stage=0, recompute="none")
    assert auto.plan.expert_parallel == 2 and auto.plan.expert_params
    graph = auto.ranks[0].stages[0].gm
    kinds = [type(graph.get_submodule(n.target)).__name__ for n in moe_exchange_nodes(graph)]
    assert kinds == ["MoeDispatch", "MoeCombine"] * 2


def test_a_dense_model_has_the_same_candidates():
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=2, seq_len=16)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (8, 16), generator=g)
    prof = profile_model(model, example_inputs=(x,), loss_fn=lm_loss, example_target=x, tp_degrees=(1, 2))
    assert prof.moe_layers == ()
    free = search(prof, _cluster(), world=4)
    pinned = search(prof, _cluster(), world=4, space=SearchSpace(expert_parallel=(1,)))
    assert free.frontier.structures == pinned.frontier.structures
    assert {s.expert_parallel for s in free.frontier.structures} == {1}
    assert [c for c, _ in free.rejected] == [c for c, _ in pinned.rejected]
    assert not any("expert" in r for r in explain(free)) and " ep " not in format_table(free).splitlines()[0]


def test_the_choice_is_the_simulators_best_over_every_ep(profile):
    """Best-first with ep in the structures: the closed form still bounds every simulated candidate,
    and the choice is the fastest of all of them (every one simulated here)."""
    from test_planner_search import _every_fitting_candidate_simulated  # (pytest puts tests/api on the path)

    cluster = _cluster(link=Link(latency_s=1e-3, bandwidth=1e8))
    result = search(profile, cluster, world=4)
    pairs = _every_fitting_candidate_simulated(result, profile, cluster, 4)
    assert {e.candidate.expert_parallel for e, _ in pairs} == {1, 2, 4}
    assert all(e.step_time <= s.step_time * (1 + 1e-9) for e, s in pairs)
    assert result.best.step_time == pytest.approx(min(s.step_time for _, s in pairs), rel=1e-12)
