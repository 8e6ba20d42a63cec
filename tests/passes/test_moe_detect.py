"""passes/moe/moe_detect.py: MoE layers recognised in captured graphs of four models, and what is left out."""
import importlib.util

import pytest
import torch
import torch.nn as nn

from autopar.ir.meta_keys import MOE, MOE_LAYER, get_meta
from autopar.models.moe import build_hf_moe, build_moe, moe_loss
from autopar.passes.frontend.capture import capture
from autopar.passes.moe.moe_detect import annotate_moe, find_moe_layers

HF = importlib.util.find_spec("transformers") is not None


def _plain(name):
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    return capture(build_moe(name), (idx,), loss_fn=moe_loss, example_target=idx).gm


def _hf(name):
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    return capture(build_hf_moe(name), (idx, idx), keywords=("input_ids", "labels"), own_loss=True).gm


@pytest.mark.parametrize("name, form, k, scoring, shared", [
    ("switch", "gathered", 1, "softmax", False), ("deepseek", "gathered", 2, "sigmoid", True),
    ("loop_moe", "loop", 2, "softmax", False)])
def test_plain_torch_layers(name, form, k, scoring, shared):
    gm = _plain(name)
    report = annotate_moe(gm)
    assert report.unrecognised == ()
    assert [l.path for l in report.layers] == ["model.blocks.0.moe", "model.blocks.1.moe"]
    for i, layer in enumerate(report.layers):
        assert (layer.form, layer.num_experts, layer.top_k, layer.scoring) == (form, 4, k, scoring)
        assert bool(layer.shared_experts) == shared
        assert layer.aux_loss, "the load-balancing loss reads the router"
        if form == "loop":
            assert len(layer.expert_weights) == 8  # 4 experts x 2 linears, each its own module
        else:
            assert layer.expert_weights == (f"model.blocks.{i}.moe.experts.w_in", f"model.blocks.{i}.moe.experts.w_out")
    roles = {get_meta(n, MOE).role for n in gm.graph.nodes if get_meta(n, MOE) is not None}
    assert {"router", "scores", "topk", "expert_op", "expert_weight", "combine", "aux_loss"} <= roles
    routers = [n for n in gm.graph.nodes if get_meta(n, MOE_LAYER) is not None]
    assert [get_meta(n, MOE_LAYER).path for n in routers] == [l.path for l in report.layers]


@pytest.mark.skipif(not HF, reason="needs transformers")
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_hugging_face_fused_experts(name):
    report = find_moe_layers(_hf(name))
    assert report.unrecognised == ()  # the router loss's own top-k belongs to the aux loss
    assert len(report.layers) == 2
    for i, layer in enumerate(report.layers):
        assert (layer.path, layer.form, layer.num_experts, layer.top_k) == (f"model.model.layers.{i}.mlp", "grouped", 4, 2)
        assert layer.expert_weights == (f"model.model.layers.{i}.mlp.experts.gate_up_proj",
                                        f"model.model.layers.{i}.mlp.experts.down_proj")
        assert layer.offsets is not None and layer.row_ids is not None and len(layer.expert_ops) == 2
    assert report.layers[1].aux_loss  # the last layer's share ends in the loss


class _NotRouters(nn.Module):
    """A top-k of raw logits (no softmax), and a router whose top-k no expert reads."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.gate = nn.Linear(8, 4)

    def forward(self, x):
        picked = torch.topk(self.proj(x), 2, dim=-1).values.sum()
        weights, ids = torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1)
        return picked + weights.sum() + ids.float().sum()


def test_unrecognised_say_why():
    gm = capture(_NotRouters(), (torch.randn(3, 8),)).gm
    report = find_moe_layers(gm)
    assert report.layers == ()
    whys = [why for _, why in report.unrecognised]
    assert "not over a router's softmax or sigmoid" in whys[0]
    assert "no expert computation reads its top-k" in whys[1]
