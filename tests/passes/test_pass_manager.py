"""The pass manager checks every pass of the lowering, before and after the pipeline split.

A pass that breaks a graph (the whole graph, or one stage graph after the split) raises a
PassError naming the pass, the graph and the passes before it; the pipeline runs each pass once,
in its written order, each with its reason.
"""
from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.fx as fx

import autopar
import autopar.lowering as lowering
from autopar.errors import PassError
from autopar.models import build_model, lm_loss
from autopar.passes.pass_manager import PassStep, check_stage_graph, run_passes

X = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("gpt_tiny", num_layers=4)


def _plan(model, mesh, **options):
    return autopar.plan(model, mesh, example_inputs=(X,), loss_fn=lm_loss, example_target=X, capture="symbolic_trace",
                        num_microbatches=2, **options)


def _widen(gm: fx.GraphModule) -> None:
    """Corrupt ``gm`` so that it still lints and runs: the first layer norm's input twice as long on dim 0."""
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target))
    with gm.graph.inserting_before(node):
        wide = gm.graph.call_function(torch.ops.aten.cat.default, ([node.args[0], node.args[0]], 0))
    node.replace_input_with(node.args[0], wide)


def _use_before_definition(gm: fx.GraphModule) -> None:
    """Corrupt ``gm`` so that lint fails: a node reads the output of a node defined after it."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    with gm.graph.inserting_before(calls[0]):
        gm.graph.call_function(operator.add, (calls[-1], 1))


@pytest.mark.parametrize("corrupt", [_widen, _use_before_definition])
def test_a_post_split_pass_that_breaks_a_stage_graph_is_named(model, monkeypatch, corrupt):
    real = lowering.shard_parameters_zero3

    def broken(st):
        st = real(st)
        corrupt(next(stage for stage in st.stages if stage.stage == 1).gm)
        return st

    monkeypatch.setattr(lowering, "shard_parameters_zero3", broken)
    with pytest.raises(PassError, match="invalid after pass 'shard_parameters_zero3'") as info:
        _plan(model, {"dp": 2, "pp": 2}, zero_stage=3)
    assert "stage 1" in info.value.where
    assert ("passes run: ['sync_router_statistics', 'assign_stages', 'split_pipeline', 'shard_parameters_zero3']"
            in info.value.where)


def test_a_pass_that_breaks_the_whole_graph_is_named(model, monkeypatch):
    real = lowering.shard_tensor_parallel

    def broken(st):
        st = real(st)
        _widen(st.gm)
        return st

    monkeypatch.setattr(lowering, "shard_tensor_parallel", broken)
    with pytest.raises(PassError, match="invalid after pass 'shard_tensor_parallel'") as info:
        _plan(model, {"tp": 2}, ranks=[0])
    assert "RuntimeError: shape" in str(info.value)  # found by re-propagating the shapes
    assert info.value.where.startswith("graph; passes run: ['select_vocab_parallel', 'select_tp_regions', "
                                       "'shard_tensor_parallel']")


def test_an_analysis_step_is_not_re_propagated_and_may_not_rewrite(model, monkeypatch):
    """assign_stages only writes meta (an analysis): no shape re-propagation after it, and a graph it
    changes anyway is a PassError saying so."""
    import autopar.passes.pass_manager as pass_manager
    checked, real_check = [], pass_manager._check
    monkeypatch.setattr(pass_manager, "_check", lambda state, inputs: (checked.append(1), real_check(state, inputs)))
    _plan(model, {"pp": 2})
    assert len(checked) == 1  # split_pipeline's, not assign_stages'
    real = lowering.assign_stages

    def rewriting(st):
        st = real(st)
        _widen(st.gm)
        return st

    monkeypatch.setattr(lowering, "assign_stages", rewriting)
    with pytest.raises(PassError, match="invalid after pass 'assign_stages'.*declared an analysis") as info:
        _plan(model, {"pp": 2})
    assert info.value.where.startswith("graph; passes run: ['assign_stages']")


def test_a_pass_that_raises_is_named_with_the_passes_before_it(model, monkeypatch):
    def broken(st):
        raise IndexError("a bug")

    monkeypatch.setattr(lowering, "expose_weight_uses", broken)
    with pytest.raises(PassError, match="pass 'expose_weight_uses' failed: IndexError: a bug") as info:
        _plan(model, {"pp": 2}, schedule="zb_h1", zero_stage=0)
    assert info.value.where == "after passes ['assign_stages', 'split_pipeline']"


def test_every_pass_runs_once_in_the_written_order_with_its_reason(model, monkeypatch):
    ran, phases = [], []
    real = lowering.run_passes

    def recording(state, steps, **kwargs):
        steps = tuple(steps)
        phases.append({s.phase for s in steps})
        record = lambda s: (lambda st: (ran.append((s.name, s.why)), s.fn(st))[1])  # noqa: E731
        return real(state, [dataclasses.replace(s, fn=record(s)) for s in steps], **kwargs)

    monkeypatch.setattr(lowering, "run_passes", recording)
    _plan(model, {"pp": 2, "tp": 2}, schedule="zb_h1", sequence_parallel=True, recompute="full", zero_stage=0,
          ranks=[0])
    assert phases == [{"model"}, {"shard", "pipeline"}]  # captured once, lowered once (the one tp rank asked)
    assert [name for name, _ in ran] == [
        "check_plan", "capture_model", "check_batch_statistics", "check_static_shapes", "find_token_mean_loss",
        "annotate_graph", "check_captured", "bound_dynamic_dims",
        "select_vocab_parallel", "select_tp_regions", "shard_tensor_parallel", "shard_vocab_parallel",
        "select_expert_regions", "shard_expert_parallel", "shard_sequence_parallel", "fork_sharded_random",
        "assign_stages", "split_pipeline", "expose_weight_uses", "recompute"]
    assert all(len(why) > 20 for _, why in ran)


def test_stage_check_accepts_the_lowered_stages_and_refuses_a_corrupted_one(model):
    stage = _plan(model, {"pp": 2}, ranks=[1]).ranks[1].stages[0]
    check_stage_graph(stage.gm)
    _widen(stage.gm)
    stage.gm.recompile()
    with pytest.raises(ValueError, match=r"node layer_norm\w* computes \(8, 8, 32\) .* autopar.tensor says \(4, 8, 32\)"):
        check_stage_graph(stage.gm)


def test_run_passes_checks_a_plain_graph_module():
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))

    def drop_output(g):
        for node in list(g.graph.nodes):
            if node.op == "output":
                g.graph.erase_node(node)
        return g

    with pytest.raises(PassError, match="invalid after pass 'drop_output'"):
        run_passes(gm, (PassStep("drop_output", drop_output, "a broken pass for the test"),),
                   example_inputs=(torch.ones(2, 4),))
