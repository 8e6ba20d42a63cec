"""Hugging Face families as users hold them, built under ``torch.device("meta")``, plan at pp=2 x tp=2.

Each family is the library's own class from a small config of its own (autopar.models.hf.HF_RAW).
Planning never allocates a weight: the model's tensors and every rank's stage-graph tensors stay
on meta. Whatever the trace bakes in about the meta device (``_assert_tensor_metadata``, device
constants, meta buffers such as rotary ``inv_freq``) is handled by one rule in capture, not per family.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.models.hf import HF_RAW, build_hf_raw  # noqa: E402
from autopar.passes.devices import graph_devices  # noqa: E402

FAMILIES = ("llama", "gpt2", "mistral", "qwen3", "mixtral", "bert", "phi3", "gemma")


def logits_loss(output, target):
    """Cross entropy over the vocabulary, reading the ModelOutput's logits."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _graph_tensors(gm: torch.fx.GraphModule):
    yield from gm.parameters()
    yield from gm.buffers()
    for module in gm.modules():
        yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))


def test_families_cover_the_issue():
    assert set(FAMILIES) <= set(HF_RAW) and len(FAMILIES) >= 8


@pytest.mark.parametrize("name", FAMILIES)
def test_meta_built_family_plans_without_allocating(name):
    model = build_hf_raw(name, device="meta", use_cache=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 8), generator=gen)
    targets = torch.randint(0, 128, (4, 8), generator=gen)
    result = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=(tokens,), loss_fn=logits_loss,
                          example_target=targets)
    assert result.plan.mesh.pp == 2 and result.plan.mesh.tp == 2
    assert result.plan.param_shards, "tensor parallelism sharded nothing"
    assert all(t.is_meta for t in model.parameters()) and all(t.is_meta for t in model.buffers())
    for rank in result.ranks.values():
        for stage in rank.stages:
            real = [tuple(t.shape) for t in _graph_tensors(stage.gm) if not t.is_meta]
            assert not real, f"rank {rank.rank} stage {stage.stage} holds real tensors {real[:3]}"
            assert all(d.type != "meta" for d in graph_devices(stage.gm))
