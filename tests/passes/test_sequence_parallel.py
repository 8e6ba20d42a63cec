"""passes/tp/sequence_parallel.py: f/g become all-gather/reduce-scatter, the residual stream is seq-sharded."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import autopar
from autopar.ir.meta_keys import MODULE, TENSOR, get_meta
from autopar.models import lm_loss
from autopar.ops.collectives import (SpAllGather, SpReduceScatter, TpCopy, TpGather, TpReduce, TpScatter,
                                         collective_nodes)
from autopar.ops.tp_ops import SpGatherLinear
from autopar.ops.tp_rng import ShardedRandom

from graph_runner import example_batch, planned, tiny_model

SP = (("vocab_parallel", True), ("sequence_parallel", True))
BLOCK = {"gpt_tiny": "model.blocks.", "llama_tiny": "model.layers.", "plain_tiny": "model.h."}


def _kinds(gm, unit_prefix):
    return Counter(type(gm.get_submodule(n.target)).__name__ for n in collective_nodes(gm)
                   if get_meta(n, MODULE).unit.startswith(unit_prefix))


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_blocks_all_gather_before_columns_and_reduce_scatter_after_rows(name):
    model, _, _, result = planned(name, tp=2, options=SP)
    layers = model.cfg.num_layers
    for t in range(2):
        gm = result.graph(t)
        assert _kinds(gm, BLOCK[name]) == {"SpGatherLinear": 2 * layers, "SpReduceScatter": 2 * layers}
        assert not collective_nodes(gm, TpCopy) and not collective_nodes(gm, TpReduce)
        for node in collective_nodes(gm, SpReduceScatter) + collective_nodes(gm, SpGatherLinear):
            assert gm.get_submodule(node.target).dim == 1  # [b, s, h]: the sequence dim


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_residual_stream_is_sequence_sharded(name):
    model, x, _, result = planned(name, tp=2, options=SP)
    gm = result.graph(0)
    mb, seq, hidden = result.plan.microbatch_size, x.shape[1], model.cfg.hidden
    norms = [n for n in gm.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target)
             or (n.op == "call_function" and "rsqrt" in str(n.target))]
    assert norms
    for node in norms:
        shape = get_meta(node, TENSOR).shape
        assert shape[:2] == (mb, seq // 2), (node.name, shape)
    # the embedding's all-reduce became a reduce-scatter: the stream starts sharded
    first = collective_nodes(gm)[0]
    assert isinstance(gm.get_submodule(first.target), SpReduceScatter)
    assert get_meta(first, TENSOR).shape == (mb, seq // 2, hidden)


def test_position_table_is_scattered_and_the_lm_head_reads_a_gathered_input():
    _, _, _, result = planned("gpt_tiny", tp=2, options=SP)
    gm = result.graph(0)
    (scatter,) = collective_nodes(gm, TpScatter)
    assert get_meta(scatter, MODULE).path == "model.pos_emb" and gm.get_submodule(scatter.target).dim == 0
    head = [n for n in collective_nodes(gm, SpGatherLinear) if get_meta(n, MODULE).path == "model.lm_head"]
    assert len(head) == 1


def test_a_value_computed_whole_reads_its_sharded_inputs_gathered():
    """GPT-2: a block's Conv1D output ``[B * S, h]`` is reduce-scattered on its token rows and viewed back as rows of
    whole sequences, while the embeddings are cut on the sequence; the residual add of the two has no rule on
    shards, is computed whole and split once for the next norm: both inputs must be all-gathered first (they
    were read as shards, and the graph failed its shape check after the pass)."""
    pytest.importorskip("transformers")
    from tp_families import build_family, logits_loss
    from tp_families import example_batch as family_batch
    x, y = family_batch(batch=4, seq=8)  # microbatches of 2 rows: the Conv1D rows are then whole sequences
    result = autopar.plan(build_family("gpt2"), {"tp": 2}, example_inputs=(x,), loss_fn=logits_loss,
                          example_target=y, sequence_parallel=True, ranks=[0])
    gm = result.graph(0)
    adds = [s.args[0] for s in collective_nodes(gm, TpScatter) if "add" in str(s.args[0].target)]
    assert adds  # (the other scatter: the position table, read whole)
    for whole in adds:
        readers = [gm.get_submodule(a.target) if a.op == "call_module" else a for a in whole.all_input_nodes]
        assert all(isinstance(r, TpGather) for r in readers), (whole.name, readers)


def test_partial_gradient_parameters_are_the_replicated_ones_on_shards():
    model, _, _, result = planned("gpt_tiny", tp=2, options=SP)
    partial = set(result.lowered[0].tp_partial_grads)
    expected = {f"model.blocks.{i}.{p}" for i in range(model.cfg.num_layers)
                for p in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.proj.bias", "mlp.proj.bias")}
    assert partial == expected | {"model.ln_f.weight", "model.ln_f.bias"}
    _, _, _, llama = planned("llama_tiny", tp=2, options=SP)
    assert all(n.endswith("layernorm.weight") or n == "model.norm.weight" for n in llama.lowered[0].tp_partial_grads)
    _, _, _, plain = planned("gpt_tiny", tp=2, options=(("vocab_parallel", True),))
    assert plain.lowered[0].tp_partial_grads == () and not plain.plan.sequence_parallel


def test_pipeline_boundary_sends_the_sequence_shard():
    model, x, _, result = planned("gpt_tiny", pp=2, tp=2, options=SP)
    first, last = result.lowered[0].stages
    (edge,) = first.sends
    assert edge.shape == (result.plan.microbatch_size, x.shape[1] // 2, model.cfg.hidden)
    assert last.recvs[0].shape == edge.shape


def test_zero_bubble_schedules_keep_the_gather_apart_from_the_linears():
    _, _, _, result = planned("gpt_tiny", pp=2, tp=2, options=SP + (("schedule", "zb_h1"),))
    gm = result.lowered[0].stages[0].gm
    assert collective_nodes(gm, SpAllGather) and not collective_nodes(gm, SpGatherLinear)


def test_dropout_on_sequence_shards_draws_from_the_rank_stream():
    _, _, _, result = planned("plain_tiny", tp=2, overrides=(("resid_dropout", 0.1),), options=SP)
    gm = result.graph(0)
    randoms = [n for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), ShardedRandom)]
    assert len(randoms) == 4 and not [n for n in gm.graph.nodes if "dropout" in str(n.target)]


def test_sequence_not_divisible_by_tp_raises_sharding_error():
    model = tiny_model("llama_tiny", (("num_kv_heads", 4),))
    x, y = example_batch(model.cfg.vocab_size, seq=10)
    with pytest.raises(autopar.ShardingError) as info:
        autopar.plan(model, {"tp": 4}, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                     sequence_parallel=True)
    err = info.value
    assert "sequence parallelism" in err.what and "size 10" in err.what and "tp=4" in err.what
    assert "model." in err.where
    assert "multiple of 4" in err.fix and "sequence_parallel=False" in err.fix
