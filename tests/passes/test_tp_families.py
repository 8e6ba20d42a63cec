"""Tensor parallelism across transformers families, from the graph alone (passes/tp/tp_rules.py,
tp_regions.py, tensor_parallel.py): Conv1D's (in, out) weights, Falcon's ``x @ W.T``, fused qkv
of every layout, fewer kv heads than tp (multi-query included), ALiBi, partial rotary, q/k norms.

Each family is a small config of its own quirks (tests/tp_families.py). Coverage and collectives
are read off ``autopar.plan`` in this process; equality to one device runs in one spawned group per
world size (many cases each).
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.ir.meta_keys import MODULE, get_meta  # noqa: E402
from autopar.ops.collectives import TpCopy, TpReduce, collective_nodes  # noqa: E402
from autopar.ops.tp_ops import TpGradSum, TpGroupGradSum  # noqa: E402
from autopar.ops.tp_reduce_ops import TpPartialSum  # noqa: E402
from case_marks import by_world  # noqa: E402
from equivalence import Case, assert_equivalent, run_cases  # noqa: E402
from tp_families import build_family, example_batch, logits_loss, reference  # noqa: E402

# (family, tp, layers' block path): each shards every projection of attention and MLP
PLANNED = [
    ("gpt2", 2, "transformer.h"), ("gpt2", 4, "transformer.h"),  # Conv1D: addmm with (in, out) weights
    ("gptj", 2, "transformer.h"), ("gptj", 4, "transformer.h"),  # rotate-every-two partial rotary (stack)
    ("bloom", 2, "transformer.h"), ("bloom", 4, "transformer.h"),  # per-head fused qkv, ALiBi (baddbmm)
    ("qwen3", 2, "model.layers"), ("qwen3", 4, "model.layers"),  # q/k RMSNorm over head_dim; 2 kv heads
    ("gemma2", 2, "model.layers"),  # logit soft-capping, sliding window
    ("phi3", 2, "model.layers"), ("phi3", 4, "model.layers"),  # fused [q | k | v] of unequal blocks; gate_up
    ("neox", 2, "gpt_neox.layers"),  # partial rotary
    ("mistral", 2, "model.layers"), ("mistral", 4, "model.layers"),  # sliding window; 2 kv heads over 4 ranks
    ("opt", 2, "model.decoder.layers"), ("opt", 4, "model.decoder.layers"),  # biases on every projection
    ("llama_kv2", 4, "model.layers"),  # 2 kv heads over 4 ranks
    ("llama_kv1", 2, "model.layers"),  # multi-query
    ("falcon_gqa", 2, "transformer.h"),  # grouped fused qkv per kv head, x @ W.T
    ("falcon_gqa", 4, "transformer.h"),  # ... with 2 kv groups over 4 ranks: each narrows its query heads
    ("falcon_mq", 2, "transformer.h"), ("falcon_mq", 4, "transformer.h"),  # multi-query: [q heads | k | v]
    ("gpt_bigcode", 2, "transformer.h"), ("gpt_bigcode", 4, "transformer.h"),  # multi-query: [q | k | v] split
    ("olmo2", 2, "model.layers"), ("olmo2", 4, "model.layers"),  # q/k RMSNorms over all heads; 2 kv heads
]
NORMS_OVER_HEADS = {"olmo2": 2}  # per block: the q and k norms' partial sums, each all-reduced forward
PARALLEL = {"gptj", "falcon_mq"}  # attention and MLP read one norm's output


def _embedding_weights(model) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}


@functools.lru_cache(maxsize=None)
def _planned(name: str, tp: int):
    model = build_family(name)
    x, y = example_batch()
    result = autopar.plan(model, {"tp": tp}, example_inputs=(x,), loss_fn=logits_loss, example_target=y, ranks=[0])
    return model, result


@pytest.mark.parametrize("name,tp,blocks", PLANNED, ids=[f"{n}-tp{t}" for n, t, _ in PLANNED])
def test_every_projection_weight_is_sharded(name, tp, blocks):
    """>= 95% of the elements of >= 2-D weights (embedding tables aside: the vocabulary pass's) sharded."""
    model, result = _planned(name, tp)
    embeddings = _embedding_weights(model)
    weights = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and n not in embeddings}
    sharded = sum(numel for n, numel in weights.items() if n in result.plan.param_shards)
    replicated = [n for n in weights if n not in result.plan.param_shards]
    assert sharded / sum(weights.values()) >= 0.95, replicated


@pytest.mark.parametrize("name,tp,blocks", PLANNED, ids=[f"{n}-tp{t}" for n, t, _ in PLANNED])
def test_each_block_holds_megatrons_collectives(name, tp, blocks):
    """2 forward all-reduces (g) and 2 backward (f) per block; other collectives only sum gradients of
    replicated parameters read on head shards (q/k norms, shared kv heads), backward only; a norm over
    every head's features adds one forward all-reduce of its partial sum (TpPartialSum)."""
    model, result = _planned(name, tp)
    gm = result.graph(0)
    layers = model.config.num_hidden_layers
    units = {f"model.{blocks}.{i}": 2 for i in range(layers)}

    def per_unit(kind):  # (embeddings and the LM head are the vocabulary pass's, outside the blocks)
        return Counter(u for n in collective_nodes(gm, kind) if (u := get_meta(n, MODULE).unit).startswith(
            f"model.{blocks}."))

    assert per_unit(TpReduce) == units
    norms = NORMS_OVER_HEADS.get(name, 0)
    assert per_unit(TpPartialSum) == ({u: norms for u in units} if norms else {})
    # a parallel block (attention and MLP read one norm's output) is one region: one f for both
    assert per_unit(TpCopy) == ({u: 1 for u in units} if name in PARALLEL else units)
    for node in collective_nodes(gm):
        if not get_meta(node, MODULE).unit.startswith(f"model.{blocks}."):
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, (TpReduce, TpCopy, TpPartialSum)):
            assert isinstance(module, (TpGradSum, TpGroupGradSum)), type(module)
            assert all(c.direction == "backward" for c in module.comm(4, 4))


def test_conv1d_weights_shard_on_their_own_dims():
    _, result = _planned("gpt2", 2)
    shards = result.plan.param_shards
    assert shards["transformer.h.0.attn.c_attn.weight"].dim == 1  # (in, out): a column cuts dim 1
    assert shards["transformer.h.0.attn.c_attn.weight"].chunks == 3  # [q | k | v]
    assert shards["transformer.h.0.attn.c_attn.bias"].dim == 0
    assert shards["transformer.h.0.mlp.c_proj.weight"].dim == 0  # a row cuts the input dim, 0 here


def test_kv_heads_fewer_than_tp_are_replicated_over_their_query_ranks():
    _, result = _planned("llama_kv2", 4)
    k = result.plan.param_shards["model.layers.0.self_attn.k_proj.weight"]
    assert k.parts == 2  # 2 kv heads, each on 2 of the 4 ranks
    gm = result.graph(0)
    sums = [gm.get_submodule(n.target) for n in collective_nodes(gm, TpGroupGradSum)]
    assert len(sums) == 2 * 2 and all(s.blocks == ((8, 2),) for s in sums)  # k and v of both layers
    _, mq = _planned("llama_kv1", 2)
    assert "model.layers.0.self_attn.k_proj.weight" not in mq.plan.param_shards  # one head: held whole


def test_fused_unequal_blocks_are_cut_block_by_block():
    _, result = _planned("phi3", 4)
    qkv = result.plan.param_shards["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.blocks == ((32, 0), (16, 2), (16, 2))  # q over 4 ranks; k and v: 2 kv heads over 4


def test_multi_query_kv_rows_are_held_by_every_rank():
    _, result = _planned("falcon_mq", 4)
    qkv = result.plan.param_shards["transformer.h.0.self_attention.query_key_value.weight"]
    assert qkv.blocks == ((32, 0), (8, 1), (8, 1))  # 4 q heads over 4 ranks; the one k and v head whole
    gm = result.graph(0)
    sums = [gm.get_submodule(n.target) for n in collective_nodes(gm, TpGroupGradSum)]
    assert all(s.blocks == ((8, 0), (8, 1), (8, 1)) for s in sums) and len(sums) == 2


@pytest.mark.parametrize("tp", [2, 4])
def test_unequal_split_of_a_fused_multi_query_projection_is_cut_block_by_block(tp):
    """GPT-BigCode's c_attn [q (32) | k (8) | v (8)] read by split_with_sizes: the q heads over tp, the one
    k and v head held whole by every rank (its rows' and bias's gradient summed over tp), each rank
    splitting its own blocks and broadcasting k and v to its query heads only."""
    _, result = _planned("gpt_bigcode", tp)
    shards = result.plan.param_shards
    assert shards["transformer.h.0.attn.c_attn.weight"].blocks == ((32, 0), (8, 1), (8, 1))
    assert shards["transformer.h.0.attn.c_attn.bias"].blocks == ((32, 0), (8, 1), (8, 1))
    assert shards["transformer.h.0.attn.c_proj.weight"].dim == 1  # the row: its input dim
    gm = result.graph(0)
    splits = [n for n in gm.graph.nodes if n.op == "call_function" and "split_with_sizes" in str(n.target)]
    assert len(splits) == 2 and all(list(n.args[1]) == [32 // tp, 8, 8] for n in splits)
    expands = [n for n in gm.graph.nodes if n.op == "call_function" and "expand" in str(n.target)
               and len(n.args[1]) == 5]  # repeat_kv's (batch, 1, q heads, seq, head_dim): this rank's heads
    assert len(expands) == 4 and all(n.args[1][2] == 4 // tp for n in expands)
    sums = [gm.get_submodule(n.target) for n in collective_nodes(gm, TpGroupGradSum)]
    local = ((32 // tp, 0), (8, 1), (8, 1))  # weight and bias of each layer's c_attn
    assert len(sums) == 4 and all(s.blocks == local for s in sums)
    params = dict(gm.named_parameters())
    assert params["model.transformer.h.0.attn.c_attn.weight"].shape == (32 // tp + 16, 32)  # q rows cut, k, v whole
    assert params["model.transformer.h.0.attn.c_proj.weight"].shape == (32, 32 // tp)


class _SplitGQA(torch.nn.Module):
    """A fused [q | k | v] read by split_with_sizes, 2 kv heads broadcast to 4 query heads (repeat_kv)."""

    def __init__(self, d=32, heads=4, kv=2):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.qkv = torch.nn.Linear(d, d + 2 * kv * self.hd)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split([d, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = (t.view(b, s, self.kv, self.hd).transpose(1, 2)[:, :, None].expand(
            b, self.kv, self.heads // self.kv, s, self.hd).reshape(b, self.heads, s, self.hd) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("tp", [2, 4])
def test_split_fused_gqa_blocks_compute_the_models_output(tp):
    """The unequal split with 2 kv heads: the kv blocks cut in 2 at tp=4 (each on 2 ranks), evenly at tp=2;
    the ranks' forward (run in lockstep) gives the model's loss."""
    from graph_runner import run_forward
    torch.manual_seed(0)
    model = _SplitGQA()
    x, y = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    result = autopar.plan(model, {"tp": tp}, example_inputs=(x,), loss_fn=torch.nn.functional.mse_loss,
                          example_target=y, num_microbatches=1)
    kv_parts = 2 if tp == 4 else 0
    assert result.plan.param_shards["qkv.weight"].blocks == ((32, 0), (16, kv_parts), (16, kv_parts))
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(model(x), y)
    for out in run_forward(result, {"x": x, "target": y}):
        torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, want, rtol=1e-5, atol=1e-6)


def test_alibi_slopes_are_cut_per_rank_without_communication():
    _, result = _planned("bloom", 2)
    code = result.graph(0).code
    assert "local_shard" in code  # each rank its heads' ALiBi biases


# equality to one device: the families fixed here at tp=2 (OLMo 2's norms over all heads, T5's position
# tables); at tp=4 a GQA-replicated, fused layouts, multi-query kv heads held whole (Falcon, GPT-BigCode)
# and OLMo 2's k norm over 2 kv heads on 4 ranks; pp=2 x tp=2 for six of them (T5 cut inside its
# encoder: its head-sharded position bias crosses the stages) (the 4-rank group)
_EQ = dict(kind="tp_families:train", steps=2, batch=4, seq=8)
TP2 = [Case(model=n, mesh=(1, 1, 2), **_EQ) for n in ("gpt2", "gptj", "bloom", "qwen3", "phi3", "falcon_gqa",
                                                       "llama_kv1", "falcon_mq", "gpt_bigcode", "olmo2", "t5",
                                                       "gemma2", "neox", "mistral", "opt")] + [
    Case(model="gpt2", mesh=(1, 1, 2), options=(("sequence_parallel", True),), **_EQ)]  # a residual add computed whole
TP4 = [Case(model=n, mesh=(1, 1, 4), **_EQ) for n in ("llama_kv2", "phi3", "falcon_gqa", "falcon_mq",
                                                       "gpt_bigcode", "olmo2")] + [
    Case(model=n, mesh=(1, 2, 2), **_EQ) for n in ("gpt2", "phi3", "bloom", "llama_kv1", "olmo2")] + [  # pp=2 x tp=2
    Case(model="t5", mesh=(1, 2, 2), extra=(("stage_starts", ("encoder.block.1",)),), **_EQ)]


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = TP2 if world == 2 else TP4
    return dict(zip(cases, run_cases(cases)))


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(TP2 + TP4, ids=lambda c: c.name()))
def test_family_trains_equal_to_one_device(case):
    result = _results(case.world_size)[case]
    assert_equivalent(case, result, reference(case))
    assert result["sharded"]
