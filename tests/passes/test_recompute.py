"""Activation recomputation (passes/pipeline/recompute.py): the regions, equal gradients, less memory, as predicted."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import autopar
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.memory import stage_activations
from autopar.models import build_model, lm_loss
from autopar.ops.collectives import TpCopy, TpReduce
from autopar.ops.p2p import p2p_nodes
from autopar.ops.recompute import Recompute, recompute_modules
from autopar.passes.pipeline.recompute import apply_recompute, recompute_regions
from autopar.runtime.diagnostics.memory_probe import SavedLedger
from case_marks import by_world
from equivalence import assert_equivalent, reference_run
from memory_harness import RECOMPUTE, results

MODES = ("none", "selective", "full")


@functools.lru_cache(maxsize=None)
def _plan(model_name="gpt_tiny", mesh=(1, 1, 1), **options):
    """One plan per distinct request (capture costs seconds); tests copy graphs before changing them."""
    torch.manual_seed(0)
    model = build_model(model_name, seq_len=16)
    idx = torch.randint(0, 128, (4, 16))
    tgt = torch.randint(0, 128, (4, 16))
    return autopar.plan(model, mesh, example_inputs=(idx,), loss_fn=lm_loss, example_target=tgt,
                        num_microbatches=mesh[1], **options), {"idx": idx, "target": tgt}


def _blocks(gm):
    return sorted({get_meta(n, MODULE).unit for n in gm.graph.nodes
                   if get_meta(n, MODULE) is not None and get_meta(n, MODULE).unit.split(".")[-1].isdigit()})


def test_full_is_one_region_per_block():
    result, _ = _plan("gpt_tiny", (1, 2, 2))
    for stage in result.lowered[0].stages:
        gm = copy.deepcopy(stage.gm)
        regions = recompute_regions(gm, mode="full")
        units = [{get_meta(n, MODULE).unit for n in r} for r in regions]
        assert all(len(u) == 1 for u in units)
        assert [u.pop() for u in units] == _blocks(stage.gm)
        assert not any(n in set(p2p_nodes(gm)) for r in regions for n in r)
        assert not any(n.op == "get_attr" for r in regions for n in r)


def test_selective_cuts_at_forward_collectives_only():
    result, _ = _plan("gpt_tiny", (1, 2, 2))
    gm = copy.deepcopy(result.graph(0))
    regions = recompute_regions(gm, mode="selective")
    kinds = [type(gm.get_submodule(n.target)) for r in regions for n in r if n.op == "call_module"]
    assert TpCopy in kinds and TpReduce not in kinds  # f (identity forward) may recompute, g never
    assert len(regions) == 3 * len(_blocks(gm))  # attention | residual + mlp | residual: cut at each g


def test_rewritten_graph_shows_checkpointed_calls():
    result, _ = _plan("gpt_tiny", (1, 2, 1), recompute="full")
    assert result.plan.recompute == ("full", "full")
    for stage in result.lowered[0].stages:
        calls = [n.target for n in stage.gm.graph.nodes if n.op == "call_module"]
        regions = [c for c in calls if c.startswith("recompute_")]
        assert len(regions) == len(_blocks(stage.gm)) == 1
        assert "recompute_0" in stage.gm.code
        assert (calls.index("recompute_0") > calls.index("recv_0")) if stage.stage else calls[-1].startswith("send_")


def test_plan_chooses_per_stage_and_round_trips():
    result, _ = _plan("gpt_tiny", (1, 2, 1))
    plan = result.plan.model_copy(update={"recompute": ("full", "none")})
    again, _ = _plan.__wrapped__("gpt_tiny", (1, 2, 1), plan=autopar.Plan.model_validate_json(plan.model_dump_json()))
    assert not recompute_modules(result.lowered[0].stages[0].gm)
    assert again.plan.recompute == ("full", "none")
    assert recompute_modules(again.lowered[0].stages[0].gm) and not recompute_modules(again.lowered[0].stages[1].gm)


def test_bad_modes_are_plan_errors():
    with pytest.raises(autopar.PlanError, match="recompute"):
        autopar.CompileOptions(recompute="everything")
    result, _ = _plan("gpt_tiny", (1, 2, 1))
    with pytest.raises(autopar.PlanError, match="recompute modes given for 2 stages"):
        autopar.Plan.model_validate({**result.plan.model_dump(), "recompute": ("full",)})


def _run(gm, inputs, names):
    """Forward + backward of one stage graph; (loss, grads, bytes saved for backward)."""
    ledger = SavedLedger()
    args = [inputs[n] for n in names]
    ledger.exclude(list(gm.parameters()) + list(gm.buffers()) + args)
    for region in recompute_modules(gm):
        region.observer = ledger.hold
    with ledger.watch():
        out = gm(*args)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.item(), {k: p.grad for k, p in gm.named_parameters()}, ledger.total()


@pytest.mark.parametrize("model_name", ["gpt_tiny", "llama_tiny"])
def test_equal_gradients_and_memory_as_predicted(model_name):
    """Single device: every mode gives the same loss and gradients; saved bytes drop as the calculator says."""
    result, inputs = _plan(model_name)
    stage = result.lowered[0].stages[0]
    runs = {}
    for mode in MODES:
        gm = apply_recompute(copy.deepcopy(stage.gm), mode=mode)
        runs[mode] = _run(gm, inputs, stage.input_names)
        assert runs[mode][2] == stage_activations(gm).saved, mode  # prediction == measurement
        assert all(isinstance(m, Recompute) and m.mode == mode for m in recompute_modules(gm))
    loss, grads, _ = runs["none"]
    for mode in ("selective", "full"):
        assert runs[mode][0] == loss
        for k, g in grads.items():
            torch.testing.assert_close(runs[mode][1][k], g, rtol=1e-5, atol=1e-7)
    assert runs["full"][2] < runs["selective"][2] < runs["none"][2]


def test_full_keeps_only_block_inputs():
    """Full recompute trades what the block saved for its input: the difference is the block's transient."""
    full, _ = _plan("gpt_tiny", (1, 2, 1), recompute="full")
    none, _ = _plan("gpt_tiny", (1, 2, 1))
    kept = stage_activations(full.lowered[0].stages[1].gm)  # recv -> blocks.1 -> norm, head, loss
    saved = stage_activations(none.lowered[0].stages[1].gm).saved
    assert saved - kept.saved == kept.transient > 0
    region = recompute_modules(full.lowered[0].stages[1].gm)[0]
    assert sum(1 for n in region.body.graph.nodes if n.op == "placeholder" and "weight" not in n.name
               and "bias" not in n.name) == 1  # one activation input: the block's


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(RECOMPUTE, ids=lambda c: c.name().split("-", 1)[1]))
def test_recompute_trains_like_one_device(case):
    """pp x tp with recompute (collectives recomputed inside regions, p2p never) equals one device at 1e-5.

    The activation figures of the same runs are checked in tests/runtime/test_memory_measured.py.
    """
    result = results(case.world_size)[case]
    assert_equivalent(case, result, reference_run(case))


def test_describe_rank_shows_what_regions_run():
    result, _ = _plan("gpt_tiny", (1, 2, 2), recompute="full")
    text = result.describe_rank(0)
    assert "### recompute_0 (full recompute)" in text and "self.tp_reduce_0(" in text
