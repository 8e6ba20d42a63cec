"""Models nobody here wrote: transformers' GPT-2, Llama, Qwen2, BERT, ConvNeXt and ResNet, built from
their configs with random weights, held to the equivalence harness on dp, pp and tp meshes.

Where autopar cannot shard a pattern it warns (naming the node); where it cannot be exact (BatchNorm
statistics over part of the batch) it refuses with a PlanError. The spawned cases live in
tests/shared_groups.py (one 2-rank group shared with the checkpoint and fault tests).
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.errors import PlanError  # noqa: E402
from autopar.models import lm_loss  # noqa: E402
from autopar.models.hf import HF_MODELS, build_hf_model, hf_batch  # noqa: E402
from equivalence import Case, assert_equivalent, reference_run  # noqa: E402

import shared_groups as groups  # noqa: E402


def _example(name: str, batch: int = 8):
    torch.manual_seed(0)
    model = build_hf_model(name)
    x, y = hf_batch(name, batch=batch, seq=16, vocab=model.cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    return model, x, y


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_library_model_keeps_its_names_and_loads_its_own_state_dict(name):
    """The logits-only subclass is the library's model: same state_dict keys, loadable both ways."""
    import transformers
    model, x, _ = _example(name)
    base = type(model).__mro__[1]
    assert base.__module__.startswith("transformers.")
    plain = base(model.config)
    plain.load_state_dict(model.state_dict(), strict=True)
    out = model(x)
    assert isinstance(out, torch.Tensor) and out.shape[0] == x.shape[0]
    assert transformers.__version__


@functools.lru_cache(maxsize=None)
def _reference(model: str) -> dict:
    return reference_run(Case(model=model))


@pytest.mark.dist
@pytest.mark.parametrize("case", groups.HF_CASES, ids=lambda c: c.name())
def test_library_model_trains_like_one_device(case):
    result = groups.result(case)
    assert_equivalent(case, result, _reference(case.model))


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"pp": 2}])
def test_batchnorm_over_part_of_the_batch_is_refused(mesh):
    """ResNet's BatchNorm normalises by batch statistics: with dp=2, or pp=2's microbatches, each
    forward sees part of the batch, so autopar refuses instead of training something else."""
    model, x, y = _example("hf_resnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanError) as info:
        autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    text = str(info.value)
    assert "BatchNorm in training mode" in text and "node batch_norm" in text
    assert "resnet.embedder.embedder.normalization" in text
    assert "num_microbatches=1" in text and ".eval()" in text
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing lost


def test_batchnorm_with_frozen_statistics_plans_on_dp():
    model, x, y = _example("hf_resnet")
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.eval()
    result = autopar.plan(model, {"dp": 2, "pp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    assert result.plan.mesh.dp == 2


def test_unshardable_patterns_warn_naming_the_node(caplog):
    """GPT-2's Conv1D is addmm with a (in, out) weight: a projection, sharded on the weight's dim 1
    (columns) and 0 (rows) without a warning; BERT's MLM-head dense, whose shard stops at a layer_norm, is a
    column with its output all-gathered (passes/tp/tp_gather_output.py), without a warning either."""
    model, x, y = _example("hf_gpt2")
    with caplog.at_level(logging.WARNING, logger="autopar.passes.tp.tp_regions"):
        result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    assert "c_attn" not in caplog.text and "c_fc" not in caplog.text
    shards = result.plan.param_shards
    assert shards["transformer.h.0.attn.c_attn.weight"].dim == 1 and shards["transformer.h.0.mlp.c_proj.weight"].dim == 0
    assert shards["transformer.h.0.attn.c_attn.weight"].chunks == 3  # fused [q | k | v]
    caplog.clear()
    model, x, y = _example("hf_bert")
    with caplog.at_level(logging.WARNING, logger="autopar.passes.tp.tp_regions"):
        result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    assert "cls.predictions.transform.dense" not in caplog.text
    assert len(result.plan.tp_regions) >= 5  # attention and MLP of both layers, and the head's dense
    gathered = [r for r in result.plan.tp_regions if r.gathered]
    assert [(r.columns, r.rows, r.gathered) for r in gathered] == [
        (("cls.predictions.transform.dense",), (), ("cls.predictions.transform.dense",))]
    assert result.plan.param_shards["cls.predictions.transform.dense.weight"].dim == 0


def test_llama_shards_attention_and_mlp():
    model, x, y = _example("hf_llama")
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    columns = {c for r in result.plan.tp_regions for c in r.columns}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"} <= columns
