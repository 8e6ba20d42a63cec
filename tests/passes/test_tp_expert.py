"""passes/moe/tp_expert.py: every expert's MLP column/row-sharded over tp (3-D fused expert weights, grouped
or gathered by expert id), and per-expert module lists sharded by the region finder as ordinary linears."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.ir.shard_layout import ShardLayout
from autopar.ops.collectives import TpCopy, TpReduce

from autopar.models.hf import build_hf_raw, hf_raw_example
from autopar.models.moe import build_moe, moe_loss

from graph_runner import run_forward


@pytest.fixture(scope="module")
def mixtral():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build_hf_raw("mixtral", use_cache=False)
    (x,), loss_fn, y = hf_raw_example("mixtral")
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                          num_microbatches=1, vocab_parallel=False)  # the lockstep runner: f and g only
    return model, x, loss_fn, y, result


def test_fused_expert_weights_are_column_and_row_sharded(mixtral):
    _, _, _, _, result = mixtral
    shards = result.plan.param_shards
    for layer in (0, 1):
        experts = f"model.layers.{layer}.mlp.experts"
        assert shards[f"{experts}.gate_up_proj"] == ShardLayout(dim=1, chunks=2)  # gate and up blocks, each split
        assert shards[f"{experts}.down_proj"] == ShardLayout(dim=2)
    gm = result.lowered[1].stages[0].gm
    assert tuple(gm.get_parameter("model.model.layers.0.mlp.experts.gate_up_proj").shape) == (4, 64, 32)
    assert tuple(gm.get_parameter("model.model.layers.0.mlp.experts.down_proj").shape) == (4, 32, 32)


def test_one_all_reduce_forward_and_one_backward_per_expert_layer(mixtral):
    _, _, _, _, result = mixtral
    gm = result.lowered[0].stages[0].gm
    kinds = [(type(gm.get_submodule(n.target)).__name__, n.target) for n in gm.graph.nodes if n.op == "call_module"]
    expert_copies = [t for k, t in kinds if k == TpCopy.__name__ and t.startswith("tp_expert")]
    expert_reduces = [t for k, t in kinds if k == TpReduce.__name__ and t.startswith("tp_expert")]
    assert len(expert_copies) == len(expert_reduces) == 2  # f and g of each layer's experts, any expert count


def test_sharded_experts_compute_the_models_loss(mixtral):
    model, x, loss_fn, y, result = mixtral
    losses = run_forward(result, {"input_ids": x, "target": y})
    with torch.no_grad():
        want = loss_fn(model(x), y)
    for out in losses:  # the stage's outputs: the loss first
        torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["switch", "deepseek"])
def test_experts_gathered_by_id_are_column_and_row_sharded(name):
    """w_in[ids] @ / w_out[ids] @ (plain-torch fused experts): w_in on its output dim, w_out on its input dim."""
    torch.manual_seed(0)
    model = build_moe(name)
    idx = torch.randint(0, 64, (4, 16))
    result = autopar.plan(model, {"tp": 2}, example_inputs=(idx,), loss_fn=moe_loss, example_target=idx,
                          num_microbatches=1, vocab_parallel=False)
    for layer in (0, 1):
        assert result.plan.param_shards[f"blocks.{layer}.moe.experts.w_in"] == ShardLayout(dim=2)
        assert result.plan.param_shards[f"blocks.{layer}.moe.experts.w_out"] == ShardLayout(dim=1)
    gm = result.lowered[1].stages[0].gm
    assert tuple(gm.get_parameter("model.blocks.0.moe.experts.w_in").shape) == (4, 32, 32)
    kinds = [n.target for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith("tp_expert")]
    assert kinds == ["tp_expert_copy_0", "tp_expert_reduce_0", "tp_expert_copy_1", "tp_expert_reduce_1"]
    with torch.no_grad():
        want = moe_loss(model(idx), idx)
    losses = run_forward(result, {"idx": idx, "target": idx})
    assert len(losses) == 2
    for out in losses:  # each tp rank's loss
        torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, want, rtol=1e-5, atol=1e-6)


def test_coverage_names_expert_columns_and_rows():
    pytest.importorskip("transformers")
    model = build_hf_raw("qwen3_moe", device="meta")
    inputs, loss_fn, y = hf_raw_example("qwen3_moe")
    report = autopar.coverage(model, inputs, tp=2, loss_fn=loss_fn, example_target=y)
    up = report.weight("model.layers.0.mlp.experts.gate_up_proj")
    down = report.weight("model.layers.0.mlp.experts.down_proj")
    assert (up.how, up.dim, up.chunks) == ("expert column", 1, 2) and (down.how, down.dim) == ("expert row", 2)
    assert report.share >= 0.99


class _ListMoE(nn.Module):
    """A plain torch MoE: top-1 routing over a list of per-expert MLP modules."""

    def __init__(self, hidden=16, inner=32, num_experts=4):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))
                                     for _ in range(num_experts))

    def forward(self, x):
        gates = F.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # dense over experts: static shapes, as export needs
            out = out + gates[..., e:e + 1] * expert(x)
        return out


def test_per_expert_module_lists_shard_as_linears():
    torch.manual_seed(0)
    model = _ListMoE()
    report = autopar.coverage(model, (torch.randn(4, 8, 16),), tp=2)
    for e in range(4):
        assert report.weight(f"experts.{e}.0.weight").how == "column"
        assert report.weight(f"experts.{e}.2.weight").how == "row"
    assert report.weight("router.weight").how == "replicated" and "softmax" in report.weight("router.weight").reason
