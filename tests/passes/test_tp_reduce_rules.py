"""Reductions over a tensor-parallel shard (passes/tp/tp_reduce_rules.py) and shards pulled back to position
tables (passes/tp/tp_pullback_rules.py), read off ``autopar.plan`` in this process.

OLMo 2's q/k RMSNorms reduce over every head's features before the head split: each is a partial sum
all-reduced forward (one :class:`TpPartialSum` per norm), its result read back on the shards through a
:class:`TpGradSum`, its 1-D weight sliced. T5's ``relative_attention_bias`` (an embedding of (buckets,
heads)) and Swin's ``relative_position_bias_table`` (indexed, then permuted to heads) are column-sharded
on their heads. Equality to one device: tests/passes/test_tp_families.py (olmo2 and t5 in its groups).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.ir.meta_keys import MODULE, TENSOR, Placement, TensorInfo, get_meta  # noqa: E402
from autopar.models.hf import build_hf_raw, hf_raw_example  # noqa: E402
from autopar.ops.collectives import TpCopy, TpReduce, collective_nodes  # noqa: E402
from autopar.ops.tp_ops import TpGradSum  # noqa: E402
from autopar.ops.tp_reduce_ops import TpPartialSum  # noqa: E402
from autopar.passes.tp.tp_errors import NoRule  # noqa: E402
from autopar.passes.tp.tp_pullback_rules import embedding_back, index_back  # noqa: E402
from autopar.passes.tp.tp_reduce_rules import PARTIAL, partial_sum_rule  # noqa: E402
from autopar.passes.tp.tp_rules import reduce_dims  # noqa: E402
from tp_families import build_family, example_batch, logits_loss  # noqa: E402


@functools.lru_cache(maxsize=None)
def _olmo2(tp: int):
    x, y = example_batch()
    return autopar.plan(build_family("olmo2"), {"tp": tp}, example_inputs=(x,), loss_fn=logits_loss,
                        example_target=y, ranks=[0])


@functools.lru_cache(maxsize=None)
def _raw(name: str, tp: int):
    inputs, loss_fn, target = hf_raw_example(name)
    return autopar.plan(build_hf_raw(name, device="meta"), {"tp": tp}, example_inputs=inputs, loss_fn=loss_fn,
                        example_target=target, ranks=[0])


@pytest.mark.parametrize("tp", [2, 4])
def test_each_norm_over_all_heads_is_one_forward_all_reduce_of_its_partial_sum(tp):
    gm = _olmo2(tp).graph(0)
    sums = collective_nodes(gm, TpPartialSum)
    per_norm = sorted(get_meta(n, MODULE).path.rsplit(".", 1)[-1] for n in sums)
    assert per_norm == ["k_norm", "k_norm", "q_norm", "q_norm"]  # 2 layers
    for node in sums:
        module = gm.get_submodule(node.target)
        assert module.scale == pytest.approx(1 / tp)  # a mean: the sum of the local means over tp
        assert [c.direction for c in module.comm(4, 4)] == ["forward"]
        (reduced,) = node.all_input_nodes
        assert reduced.target is torch.ops.aten.mean.dim  # right after the local mean
    # the statistic is read back on the shards through an f (each rank's gradient of it is partial)
    grad_sums = [n for n in collective_nodes(gm, TpGradSum) if "norm" in get_meta(n, MODULE).path]
    assert len(grad_sums) == 4
    assert all(n.args[0].target is torch.ops.aten.rsqrt.default for n in grad_sums)


def test_the_norm_weights_are_sliced_with_their_features():
    shards = _olmo2(2).plan.param_shards
    assert shards["model.layers.0.self_attn.q_norm.weight"].dim == 0
    assert shards["model.layers.0.self_attn.q_proj.weight"].dim == 0
    assert shards["model.layers.0.self_attn.o_proj.weight"].dim == 1
    kv4 = _olmo2(4).plan.param_shards  # 2 kv heads over 4 ranks: the k norm's pieces as the k heads'
    assert kv4["model.layers.0.self_attn.k_norm.weight"].parts == 2
    assert kv4["model.layers.0.self_attn.k_proj.weight"].parts == 2


@pytest.mark.parametrize("tp", [2, 4])
def test_t5_position_tables_are_column_sharded_on_their_heads(tp):
    result = _raw("t5", tp)
    shards = result.plan.param_shards
    for stack in ("encoder", "decoder"):
        table = shards[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        assert (table.dim, table.parts) == (1, 0)
        for block in (0, 1):  # block 1 reads block 0's position bias: its attention is sharded too
            for proj, dim in (("q", 0), ("k", 0), ("v", 0), ("o", 1)):
                assert shards[f"{stack}.block.{block}.layer.0.SelfAttention.{proj}.weight"].dim == dim
    # each rank looks up its own heads' columns: the lookup of (buckets, heads / tp)
    gm = result.graph(0)
    lookups = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default
               and "relative_attention_bias" in str(n.args[0].target)]
    assert len(lookups) == 2 and all(get_meta(n, TENSOR).shape[-1] == 4 // tp for n in lookups)


def test_swin_tables_follow_their_heads_kv_style_where_heads_are_fewer_than_tp():
    two, four = _raw("swin", 2).plan.param_shards, _raw("swin", 4).plan.param_shards
    table = "swin.encoder.layers.{}.blocks.0.attention.relative_position_bias.relative_position_bias_table"
    assert (two[table.format(0)].dim, two[table.format(0)].parts) == (1, 0)
    assert (four[table.format(0)].dim, four[table.format(0)].parts) == (1, 2)  # 2 heads over 4 ranks
    assert (four[table.format(1)].dim, four[table.format(1)].parts) == (1, 0)  # 4 heads over 4 ranks


def _node(graph: fx.Graph, name: str, shape, *args, target=torch.ops.aten.sum.dim_IntList) -> fx.Node:
    node = graph.call_function(target, args) if args else graph.placeholder(name)
    node.meta[TENSOR] = TensorInfo(shape=tuple(shape), dtype=torch.float32, nbytes=0)
    return node


def test_a_reduction_over_the_shard_is_a_partial_sum_and_others_keep_their_rule():
    graph = fx.Graph()
    x = _node(graph, "x", (2, 8, 32))
    rule = partial_sum_rule(reduce_dims)
    over = _node(graph, "", (2, 8, 1), x, [-1], True)
    assert rule(over, {x: Placement.shard(2)}) == (PARTIAL, {x: Placement.shard(2)})
    assert rule(over, {x: Placement.shard(2, parts=2)})[0] == PARTIAL
    keep = _node(graph, "", (2, 32), x, [1])
    assert rule(keep, {x: Placement.shard(2)})[0] == Placement.shard(1)  # the shard kept: reduce_dims' answer
    everything = _node(graph, "", (), x, target=torch.ops.aten.sum.default)
    assert rule(everything, {x: Placement.shard(0)})[0] == PARTIAL
    with pytest.raises(NoRule):
        rule(over, {x: Placement.shard(2, blocks=((16, 0), (16, 2)))})


def test_pull_backs_refuse_a_shard_the_table_cannot_give():
    graph = fx.Graph()
    table, ids = _node(graph, "table", (32, 4)), _node(graph, "ids", (8, 8))
    lookup = _node(graph, "", (8, 8, 4), table, ids, target=torch.ops.aten.embedding.default)
    assert embedding_back(lookup, Placement.shard(2)) == {table: Placement.shard(1), ids: Placement("R")}
    with pytest.raises(NoRule):
        embedding_back(lookup, Placement.shard(0))  # a dim of the ids
    idx = _node(graph, "idx", (256,))
    picked = _node(graph, "", (256, 4), table, [idx], target=torch.ops.aten.index.Tensor)
    assert index_back(picked, Placement.shard(1, parts=2)) == {table: Placement.shard(1, parts=2),
                                                              idx: Placement("R")}
    with pytest.raises(NoRule):
        index_back(picked, Placement.shard(0))  # the dim the index tensor makes


class _HandLayerNorm(torch.nn.Module):
    """A LayerNorm written out over a column's features, before a row: ``x - mean`` reads the reduction."""

    def __init__(self):
        super().__init__()
        self.q, self.o = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.w, self.b = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = self.q(x)
        d = h - h.mean(-1, keepdim=True)
        return self.o(torch.relu(d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w + self.b))


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _lockstep(gms: list, inputs: list) -> list:
    """Every tp rank's graph run node by node in this process, with autograd; the collectives emulated
    with their own conjugates (g: sum forward, identity backward; f: identity forward, sum backward)."""
    interps = [fx.Interpreter(gm) for gm in gms]
    for interp in interps:
        interp.env, interp.args_iter = {}, iter(inputs)
    outputs = []
    for row in zip(*[list(gm.graph.nodes) for gm in gms]):
        module = gms[0].get_submodule(row[0].target) if row[0].op == "call_module" else None
        if module is not None:
            ins = [i.env[n.args[0]] for i, n in zip(interps, row)]
            total = sum(ins)
            if isinstance(module, (TpReduce, TpPartialSum)):
                outs = [(x + (total - x).detach()) * getattr(module, "scale", 1.0) for x in ins]
            else:
                assert isinstance(module, (TpCopy, TpGradSum)), type(module)
                outs = [x.detach() + (total - total.detach()) for x in ins]
            for i, n, value in zip(interps, row, outs):
                i.env[n] = value
            continue
        for i, n in zip(interps, row):
            value = i.run_node(n)
            if n.op == "output":
                outputs.append(value[0])
            else:
                i.env[n] = value
    return outputs


def test_a_layer_norm_over_the_shard_trains_as_on_one_device():
    """Forward and backward of both tp ranks, lockstep in this process, against the module itself."""
    torch.manual_seed(0)
    model, x, y = _HandLayerNorm(), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=_mse, example_target=y, ranks=[0, 1])
    gms = [result.graph(0), result.graph(1)]
    assert len(collective_nodes(gms[0], TpPartialSum)) == 2  # the mean and the variance
    assert {"q.weight", "q.bias", "w", "b", "o.weight"} <= set(result.plan.param_shards)
    losses = _lockstep(gms, [x, y])
    sum(losses).backward()  # each rank's own loss, as every rank backpropagates its copy
    expected = _mse(model(x), y)
    expected.backward()
    for loss in losses:
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, full in model.named_parameters():
        spec = result.plan.param_shards.get(name)
        for rank, gm in enumerate(gms):
            grad = gm.get_parameter(f"model.{name}").grad
            want = full.grad if spec is None else full.grad.chunk(2, dim=spec.dim)[rank]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=f"{name} on rank {rank}")
