"""Identical blocks captured once and repeated (passes/frontend/block_template.py) give a full capture's graphs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.ir.meta_keys import TENSOR, get_meta
from autopar.models import build_model, lm_loss
from autopar.passes.frontend.block_template import MIN_BLOCKS, capture_blocks, find_block_template
from autopar.passes.frontend.capture import capture


def _signature(gm):
    rows = []
    for n in gm.graph.nodes:
        info = get_meta(n, TENSOR)
        target = type(gm.get_submodule(n.target)).__name__ if n.op == "call_module" else str(n.target)
        rows.append((n.op, target, info.shape if info else None))
    return rows


def _both(name: str, mesh, **options):
    torch.manual_seed(0)
    model = build_model(name, num_layers=4, seq_len=16)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
    return [autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, block_capture=mode,
                         **options) for mode in ("every", "once")]


@pytest.mark.parametrize("name,mesh,options", [
    ("llama_tiny", (1, 2, 2), {"sequence_parallel": True, "recompute": "full", "schedule": "zb_h1"}),
], ids=["llama-tp-sp-recompute-zb"])
def test_repeated_blocks_give_the_full_captures_graphs(name, mesh, options):
    every, once = _both(name, mesh, **options)
    assert every.captured.template is None and once.captured.template is not None
    assert once.plan == every.plan
    for rank in every.ranks:
        for a, b in zip(every.ranks[rank].stages, once.ranks[rank].stages):
            assert _signature(a.gm) == _signature(b.gm)
            pa, pb = dict(a.gm.named_parameters()), dict(b.gm.named_parameters())
            assert pa.keys() == pb.keys()
            assert all(torch.equal(pa[k], pb[k]) for k in pa)
            assert dict(a.gm.named_buffers()).keys() == dict(b.gm.named_buffers()).keys()


def test_a_repeated_graph_computes_what_the_full_one_does():
    every, once = _both("gpt_tiny", (1, 1, 1))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
    a, b = every.graph(0), once.graph(0)
    mb = every.plan.microbatch_size
    torch.testing.assert_close(a(x[:mb], y[:mb]), b(x[:mb], y[:mb]), rtol=0, atol=0)


def test_auto_repeats_only_long_lists_on_the_meta_device():
    with torch.device("meta"):
        long_meta = build_model("llama_tiny", num_layers=MIN_BLOCKS)
    assert find_block_template(long_meta).num_blocks == MIN_BLOCKS
    assert find_block_template(long_meta, mode="every") is None
    assert find_block_template(build_model("llama_tiny", num_layers=MIN_BLOCKS)) is None  # real weights
    assert find_block_template(build_model("llama_tiny", num_layers=5), mode="once") is not None
    assert find_block_template(build_model("llama_tiny", num_layers=3), mode="once") is None  # nothing to repeat


class _Gated(nn.Module):
    """Blocks with code between them and a block that reads an older block: not one block repeated."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        first = x
        for i, block in enumerate(self.blocks):
            x = block(x) * 0.5 if i % 2 else block(x) + first
        return x.sum()


def test_irregular_blocks_fall_back_to_capturing_every_block():
    model = _Gated()
    template = find_block_template(model, mode="once")
    assert template is not None
    captured, used = capture_blocks(template, lambda: capture(model, (torch.randn(2, 8),)))
    assert used is None
    assert len(model.blocks) == 6  # restored
    assert sum(1 for n in captured.gm.graph.nodes if n.op == "get_attr") == 12


def test_different_blocks_are_not_a_template():
    model = nn.Sequential()
    model.blocks = nn.ModuleList([nn.Linear(8, 8)] * 2 + [nn.Linear(8, 4)] * 4)
    assert find_block_template(model, mode="once") is None


def test_experts_split_over_ep_are_cut_in_every_repeated_block():
    """A Mixtral captured three blocks at a time, its experts split over ep=2 and each cut over tp=2: the graphs
    and weights of ep rank 0 on tp rank 0 and ep rank 1 on tp rank 1 (its own experts of every block, the repeated
    one's included) are the full capture's."""
    pytest.importorskip("transformers")
    from autopar.lowering import lower_captured
    from autopar.models.moe import build_hf_moe
    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_hidden_layers=4, output_router_logits=False)  # no aux loss across blocks
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    every, once = (autopar.plan(model, {"dp": 2, "tp": 2}, example_inputs={"input_ids": idx, "labels": idx},
                                expert_parallel=2, zero_stage=0, num_microbatches=1, block_capture=mode, ranks=[0])
                   for mode in ("every", "once"))
    assert every.captured.template is None and once.captured.template is not None
    assert once.plan == every.plan and len(once.plan.expert_params) == 2 * 4
    for ep_rank, tp_rank in ((0, 0), (1, 1)):
        a, b = ((r.ranks[0].stages[0].gm if ep_rank == 0 else
                 lower_captured(r.captured, tp_rank=tp_rank, dp_rank=ep_rank).stages[0].gm) for r in (every, once))
        assert _signature(a) == _signature(b)
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        assert all(torch.equal(pa[k], pb[k]) for k in pa), (ep_rank, tp_rank)
        # the repeated block: this ep rank's 2 of the 4 experts, each its tp half of the rows of [E, H, I]
        full = model.model.layers[3].mlp.experts.down_proj.detach()
        want = full[2 * ep_rank:2 * ep_rank + 2, :, 32 * tp_rank:32 * tp_rank + 32]
        assert torch.equal(pb["model.model.layers.3.mlp.experts.down_proj"], want)
