"""Columns with a gathered output (passes/tp/tp_gather_output.py) and buffers sliced on vocabulary-sharded
logits (passes/tp/vocab_parallel.py), read off ``autopar.plan`` in this process. Equality to one device: BERT,
RoBERTa, ViT and BART in tests/models/test_tp_families_dist.py."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.ir.meta_keys import TP_PLACEMENT, get_meta
from autopar.models.examples import gpt_tiny
from autopar.ops.collectives import TpCopy, TpGather, collective_nodes


class PatchHead(nn.Module):
    """A patch convolution, a norm, a dense the norm follows, and a classifier: ViT's embedding and BERT's head."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.norm = nn.LayerNorm(8)
        self.dense = nn.Linear(8, 8)
        self.out_norm = nn.LayerNorm(8)
        self.classifier = nn.Linear(8, 6)

    def forward(self, x):
        h = self.norm(self.patch(x).flatten(2).transpose(1, 2))
        h = self.out_norm(F.gelu(self.dense(h)))
        return self.classifier(h.mean(dim=1))


def _mse(out, target):
    return F.mse_loss(out, target)


@functools.lru_cache(maxsize=None)
def _planned(tp: int):
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 4, 4), torch.randn(4, 6)
    return autopar.plan(PatchHead(), {"tp": tp}, example_inputs=(x,), loss_fn=_mse, example_target=y, ranks=[0, 1])


def _gathers(gm):
    return {n.args[0]: gm.get_submodule(n.target) for n in collective_nodes(gm, TpGather)}


def test_conv_and_dense_are_columns_with_their_output_gathered():
    result = _planned(2)
    shards = result.plan.param_shards
    for name in ("patch.weight", "patch.bias", "dense.weight", "dense.bias", "classifier.weight"):
        assert shards[name].dim == 0 and shards[name].chunks == 1, (name, shards[name])
    # the classifier's scores reach the loss through broadcast_tensors (no rule): gathered too
    gathered = [r.gathered for r in result.plan.tp_regions]
    assert gathered == [("patch",), ("dense",), ("classifier",)] and all(not r.rows for r in result.plan.tp_regions)
    gm = result.graph(0)
    gathers = _gathers(gm)
    dims = [(src.target.__name__.split(".")[0], module.dim) for src, module in gathers.items()]
    assert dims == [("conv2d", 1), ("linear", 2), ("linear", 1)]  # channels of (b, c, h, w); features
    for src in gathers:  # the column's output holds this rank's half; the gather restores the whole
        assert get_meta(src, TP_PLACEMENT).kind == "S"
    assert len(collective_nodes(gm, TpCopy)) == 3  # each column's input: its gradient is partial


def test_logits_the_loss_reads_are_left_to_the_vocabulary_pass():
    model, (x,), loss_fn, y = gpt_tiny()
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                          vocab_parallel=False)
    assert "lm_head.weight" not in result.plan.param_shards and not any(r.gathered for r in result.plan.tp_regions)


def test_each_rank_holds_its_output_features():
    result = _planned(2)
    torch.manual_seed(0)
    torch.randn(4, 3, 4, 4), torch.randn(4, 6)  # as _planned draws its batch before the model
    full = PatchHead()
    for rank in (0, 1):
        params = {k: v for s in result.ranks[rank].stages for k, v in s.gm.named_parameters()}
        weight = next(v for k, v in params.items() if k.endswith("dense.weight"))
        assert torch.equal(weight, full.dense.weight.detach()[4 * rank: 4 * (rank + 1)])
        conv = next(v for k, v in params.items() if k.endswith("patch.weight"))
        assert conv.shape == (4, 3, 2, 2) and torch.equal(conv, full.patch.weight.detach()[4 * rank: 4 * (rank + 1)])


def test_the_gather_communicates_forward_only():
    gm = _planned(2).graph(0)
    for module in _gathers(gm).values():
        comms = module.comm(64, 128)
        assert [(c.direction, c.op) for c in comms] == [("forward", "all_gather")]  # backward: a local slice


def test_megatron_regions_keep_their_collectives():
    model, (x,), loss_fn, y = gpt_tiny()
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=loss_fn, example_target=y)
    assert all(not r.gathered and r.rows for r in result.plan.tp_regions)
    assert not [n for n in collective_nodes(result.graph(0), TpGather) if n.target.startswith("tp_gather_output")]


def test_a_convolution_tp_does_not_divide_stays_replicated():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 1)

        def forward(self, x):
            return self.conv(x).sum(dim=(1, 2, 3))

    report = autopar.coverage(Odd(), (torch.randn(2, 3, 2, 2),), tp=2, loss_fn=_mse,
                              example_target=torch.randn(2))
    conv = report.weight("conv.weight")
    assert conv.how == "replicated" and "divide" in conv.reason


def test_a_logits_bias_buffer_is_sliced_per_rank():
    pytest.importorskip("transformers")
    from autopar.models.hf import build_hf_raw, hf_raw_example
    model = build_hf_raw("bart", device="meta")
    inputs, loss_fn, target = hf_raw_example("bart")
    result = autopar.plan(model, {"tp": 2}, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          ranks=[0, 1])
    assert result.plan.param_shards["lm_head.weight"].dim == 0  # tied (model.shared): both embeddings and the head
    for rank in (0, 1):
        cuts = [n for n in result.graph(rank).graph.nodes if n.op == "call_function"
                and getattr(n.target, "__name__", "") == "local_shard"]
        assert len(cuts) == 1 and cuts[0].kwargs == dict(dim=1, chunks=1, rank=rank, size=2)
