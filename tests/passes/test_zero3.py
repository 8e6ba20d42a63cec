"""The ZeRO-3 pass: visible gather/free nodes around each unit's parameters, in a plain process."""
from __future__ import annotations

import operator

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.models import build_model, lm_loss
from autopar.runtime.collectives import collective_nodes
from autopar.runtime.zero3_ops import ZeroFree, ZeroGather


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
    assert "ZeRO stage 3 over dp (ddp, 25 MB buckets)" in plan.summary()
    with pytest.raises(PlanError, match="bucket_mb"):
        _plan(bucket_mb=0)
