"""passes/frontend/annotate.py and ir/meta_keys.py: the meta-key registry, FLOPs, bytes, module paths, tied params."""
from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from autopar.ir.meta_keys import (
    COST, META_KEYS, MODULE, PARAM, TENSOR, NodeCost, get_meta, set_meta,
)
from autopar.models import lm_loss
from autopar.passes.frontend.annotate import annotate
from autopar.passes.frontend.capture import capture

from graph_runner import captured, example_batch, tiny_model

B, S = 2, 16


def _annotated(name: str):
    model, args, graph = captured(name, batch=B)  # shared with test_capture (annotating changes no node)
    assert args[0].shape == (B, S)
    return model, annotate(graph.gm, example_inputs=args, model=model)


@pytest.fixture(scope="module")
def gpt():
    return _annotated("gpt_tiny")


@pytest.fixture(scope="module")
def llama():
    return _annotated("llama_tiny")


def _linear(gm, path: str):
    return next(n for n in gm.graph.nodes
                if n.target == torch.ops.aten.linear.default and get_meta(n, MODULE).path == path)


# --- the registry -------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(META_KEYS))
def test_every_meta_key_is_named_autopar_and_holds_a_frozen_dataclass(key):
    spec = META_KEYS[key]
    assert key.startswith("autopar.") and spec.key == key
    assert dataclasses.is_dataclass(spec.holds) and spec.holds.__dataclass_params__.frozen
    assert spec.writer and isinstance(spec.readers, tuple)


def _resolve(dotted: str):
    module, _, attr = f"autopar.{dotted}".rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("key", sorted(META_KEYS))
def test_every_meta_key_names_a_writer_that_exists(key):
    assert callable(_resolve(META_KEYS[key].writer))


def test_registry_cannot_be_changed_and_set_meta_checks_types(gpt):
    with pytest.raises(TypeError):
        META_KEYS["autopar.new"] = None  # type: ignore[index]
    _, gm = gpt
    node = next(iter(gm.graph.nodes))
    with pytest.raises(AssertionError, match="holds NodeCost"):
        set_meta(node, COST, "not a NodeCost")
    with pytest.raises(AssertionError, match="unregistered"):
        get_meta(node, "autopar.unregistered")
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_meta(node, COST).flops = 1


def test_annotated_nodes_carry_only_registered_keys_of_the_declared_type(gpt, llama):
    for _, gm in (gpt, llama):
        for node in gm.graph.nodes:
            for key, value in node.meta.items():
                if key.startswith("autopar."):
                    assert key in META_KEYS, key
                    assert isinstance(value, META_KEYS[key].holds), (node.name, key)
            assert isinstance(get_meta(node, TENSOR), META_KEYS[TENSOR].holds)
            assert isinstance(get_meta(node, COST), NodeCost)


def test_annotate_writes_meta_and_leaves_the_graph_alone():
    model = tiny_model("gpt_tiny")
    x, y = example_batch(model.cfg.vocab_size, batch=B, seq=S)
    gm = capture(model, (x,), loss_fn=lm_loss, example_target=y).gm
    before = gm.code
    annotate(gm, example_inputs=(x, y), model=model)
    assert gm.code == before


# --- costs --------------------------------------------------------------------------------

@pytest.mark.parametrize("path,fan_in,fan_out", [
    ("model.blocks.0.attn.qkv", 32, 96), ("model.blocks.0.attn.proj", 32, 32),
    ("model.blocks.1.mlp.fc", 32, 128), ("model.blocks.1.mlp.proj", 128, 32), ("model.lm_head", 32, 128),
])
def test_linear_flops_are_two_times_batch_seq_in_out(gpt, path, fan_in, fan_out):
    _, gm = gpt
    cost = get_meta(_linear(gm, path), COST)
    assert cost.flops == 2 * B * S * fan_in * fan_out  # torch.utils.flop_counter's convention
    assert cost.activation_bytes == B * S * fan_out * 4  # fp32 output


def test_llama_linear_flops_follow_the_kv_width(llama):
    model, gm = llama
    kv = model.cfg.num_kv_heads * model.cfg.head_dim
    assert get_meta(_linear(gm, "model.layers.0.attn.k_proj"), COST).flops == 2 * B * S * 32 * kv
    assert get_meta(_linear(gm, "model.layers.0.mlp.gate_proj"), COST).flops == 2 * B * S * 32 * 64


def test_attention_flops_are_counted(gpt):
    model, gm = gpt
    sdpa = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default)
    h, d = model.cfg.num_heads, model.cfg.head_dim
    assert get_meta(sdpa, COST).flops == 4 * B * h * S * S * d


def test_activation_bytes_are_output_bytes_and_zero_for_inputs_weights_and_views(gpt):
    from autopar.passes.frontend.annotate import _is_view
    _, gm = gpt
    views = 0
    for node in gm.graph.nodes:
        info, cost = get_meta(node, TENSOR), get_meta(node, COST)
        if node.op in ("placeholder", "get_attr", "output"):
            assert cost.activation_bytes == 0 and cost.flops == 0
        elif _is_view(node):  # aliases of their input hold no memory of their own
            views += 1
            assert cost.activation_bytes == 0, node.name
        elif info.shape is not None:
            assert cost.activation_bytes == math.prod(info.shape) * info.dtype.itemsize, node.name
    assert views > 0
    idx = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert get_meta(idx, TENSOR).shape == (B, S) and get_meta(idx, TENSOR).dtype == torch.int64


# --- modules and parameters ---------------------------------------------------------------

def test_module_meta_names_path_and_pipeline_unit(gpt):
    _, gm = gpt
    info = get_meta(_linear(gm, "model.blocks.1.mlp.fc"), MODULE)
    assert (info.path, info.unit) == ("model.blocks.1.mlp.fc", "model.blocks.1")
    assert get_meta(_linear(gm, "model.lm_head"), MODULE).unit == "model.lm_head"
    assert all(get_meta(n, MODULE) is None for n in gm.graph.nodes if n.op in ("placeholder", "get_attr"))


def test_tied_embedding_and_head_share_one_param_with_both_aliases(gpt):
    model, gm = gpt
    assert model.lm_head.weight is model.tok_emb.weight
    tied = [get_meta(n, PARAM) for n in gm.graph.nodes
            if n.op == "get_attr" and len(get_meta(n, PARAM).aliases) > 1]
    assert len(tied) == 1, "the tied weight is read through exactly one get_attr node"
    info = tied[0]
    assert set(info.aliases) == {"model.tok_emb.weight", "model.lm_head.weight"}
    assert info.name in info.aliases and info.is_parameter
    assert info.numel == model.cfg.vocab_size * model.cfg.hidden
    assert set(info.used_by_modules) == {"model.tok_emb", "model.lm_head"}


def test_untied_params_have_one_alias_and_record_their_users(llama):
    model, gm = llama
    params = {get_meta(n, PARAM).name: get_meta(n, PARAM) for n in gm.graph.nodes if n.op == "get_attr"}
    assert all(len(p.aliases) == 1 for p in params.values())
    named = {f"model.{k}" for k, _ in model.named_parameters()}
    assert {k for k, p in params.items() if p.is_parameter} == named
    assert params["model.layers.0.attn.q_proj.weight"].used_by_modules == ("model.layers.0.attn.q_proj",)
    buffers = [p for p in params.values() if not p.is_parameter]
    assert buffers and all("rotary" in p.name for p in buffers)
