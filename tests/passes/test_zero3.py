"""The ZeRO-3 pass: visible gather/free nodes around each unit's parameters, in a plain process."""
from __future__ import annotations

import operator

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.models import build_model, lm_loss
from autopar.ops.collectives import collective_nodes
from autopar.ops.zero3_ops import ZeroFree, ZeroGather


def _plan(mesh=(2, 1, 1), **options):
    x = torch.randint(0, 128, (8, 16))
    return autopar.plan(build_model("gpt_tiny", seq_len=16), mesh, example_inputs=(x,), loss_fn=lm_loss,
                        example_target=x, zero_stage=3, **options)


def test_one_gather_and_one_free_per_unit():
    gm = _plan().graph(0)
    gathers, frees = collective_nodes(gm, ZeroGather), collective_nodes(gm, ZeroFree)
    assert len(gathers) == len(frees) == 5  # tok/pos embeddings, 2 blocks, final norm
    assert "zero3_gather_1" in gm.code and "zero3_free_1" in gm.code
    # every trainable parameter is read by a gather, and by nothing else
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(gm.get_parameter(node.target), torch.nn.Parameter):
            assert node.users and all(u.op == "call_module" and isinstance(gm.get_submodule(u.target), ZeroGather)
                                      for u in node.users)


def test_free_follows_the_last_use_and_gather_precedes_the_first():
    gm = _plan().graph(0)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for gather in collective_nodes(gm, ZeroGather):
        fulls = [u for u in gather.users if u.target is operator.getitem]
        uses = [u for f in fulls for u in f.users if not isinstance(getattr(u, "target", None), str)
                or not u.target.startswith("zero3_free")]
        free = next(u for f in fulls for u in f.users if u.op == "call_module" and u.target.startswith("zero3_free"))
        assert all(order[gather] < order[u] < order[free] for u in uses)
        assert gm.get_submodule(free.target).gather == gather.target


def test_gathers_prefetch_in_use_order():
    gm = _plan().graph(0)
    gathers = [gm.get_submodule(n.target) for n in collective_nodes(gm, ZeroGather)]
    assert [g.next_gather for g in gathers] == [f"zero3_gather_{k + 1}" for k in range(4)] + [None]
    frees = [gm.get_submodule(n.target) for n in collective_nodes(gm, ZeroFree)]
    assert frees[0].prev_gather is None and all(f.prev_gather for f in frees[1:])


def test_dp1_leaves_the_graph_alone():
    assert not collective_nodes(_plan(mesh=(1, 2, 1)).graph(0), ZeroGather)


def test_zero3_refuses_split_backward_schedules():
    with pytest.raises(PlanError, match="zb_h1"):
        _plan(mesh=(2, 2, 1), schedule="zb_h1")


def test_plan_records_the_data_parallel_choice():
    plan = _plan().plan
    assert plan.zero_stage == 3 and plan.data_parallel == "ddp"
    assert "ZeRO stage 3 over dp (ddp, 1 MB buckets)" in plan.summary()  # 30,080 parameters: the 1 MB floor
    with pytest.raises(PlanError, match="bucket_mb"):
        _plan(bucket_mb=0)


def _moe_plan(dp):
    from autopar.models.moe import build_moe, moe_loss
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 16))
    return autopar.plan(build_moe("switch"), {"dp": dp}, example_inputs=(idx,), loss_fn=moe_loss,
                        example_target=idx, expert_parallel=2, zero_stage=3, num_microbatches=1)


def _gathers_by_axis(result):
    from autopar.ir.graph_names import user_name
    gm = result.graph(0)
    out = {}
    for node in collective_nodes(gm, ZeroGather):
        gather = gm.get_submodule(node.target)
        out.setdefault((gather.axis, gather.size, gather.divide_by), set()).update(user_name(t) for t in gather.targets)
    return out


def test_expert_tensors_are_gathered_over_the_ranks_holding_the_same_experts():
    result = _moe_plan(4)  # ep=2 of dp=4: each expert tensor over edp = 2 ranks, its gradient divided by dp
    by_axis = _gathers_by_axis(result)
    assert set(by_axis) == {("dp", 4, 4), ("edp", 2, 4)}
    assert by_axis[("edp", 2, 4)] == set(result.plan.expert_params)
    assert not by_axis[("dp", 4, 4)] & set(result.plan.expert_params)
    assert "axis='edp', size=2" in str(result.graph(0))


def test_experts_stay_whole_when_dp_equals_ep():
    result = _moe_plan(2)  # edp = 1: every rank already holds its experts alone
    by_axis = _gathers_by_axis(result)
    assert set(by_axis) == {("dp", 2, 2)} and not by_axis[("dp", 2, 2)] & set(result.plan.expert_params)


def test_memory_calculator_counts_zero3_expert_shards():
    from autopar.memory import estimate_memory
    for dp, ways in ((4, 2), (2, 1)):  # expert tensors over edp = dp / ep, everything else over dp
        result = _moe_plan(dp)
        gm = result.graph(0)
        experts = set(result.plan.expert_params)
        elements = 0
        for target, p in gm.named_parameters():
            ways_here = ways if target.partition(".")[2] in experts else dp
            elements += -(-p.numel() // ways_here)
        assert estimate_memory(result, optimizer="sgd").ranks[0].params == 4 * elements  # fp32


class _TransposedWeight(torch.nn.Module):
    """A weight read only through its transpose: the transpose is the weight's one direct user."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(x @ self.w.t()))


def test_free_follows_the_uses_of_a_view_of_the_weight():
    from autopar.passes.data_parallel.zero3 import _is_view
    x = torch.randn(8, 8)
    gm = autopar.plan(_TransposedWeight(), (2, 1, 1), example_inputs=(x,), zero_stage=3,
                      loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y),
                      example_target=torch.randn(8, 2)).graph(0)
    assert "torch.ops.aten.t.default(getitem" in gm.code  # the weight is read through its transpose
    for free in collective_nodes(gm, ZeroFree):
        views, frontier = set(), list(free.args[1:])
        while frontier:  # every view of the freed parameters
            for user in frontier.pop().users:
                if _is_view(user) and user not in views:
                    views.add(user)
                    frontier.append(user)
        # what passes through the free (and every node after it reads) is no view of the freed storage
        assert free.args[0] not in views, gm.code
