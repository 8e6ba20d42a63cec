"""The placement rules of the tensor-parallel propagation (passes/tp/tp_rules.py) for indexing, attention and the
batched products, and how a node finds its rule: each case calls one rule on hand-made nodes and pins the exact
placement it returns and the placements it asks of its inputs, or the refusal (tests/passes/test_tp_rules_layouts.py
covers the views and the other dim moves)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, TensorInfo, set_meta
from autopar.ops.context_parallel.block_math import AttentionSpec
from autopar.ops.context_parallel.layout import CpLayout
from autopar.ops.context_parallel.ring import RingAttention
from autopar.ops.context_parallel.ulysses import UlyssesAttention
from autopar.passes.tp import tp_rules
from autopar.passes.tp.tp_rules import ASSERTIONS, ELEMENTWISE, RULES, NoRule, constant_value, op_name, rule_for

from tp_rule_nodes import P, R, S, apply_rule as _apply, make_call as _call, make_input as _input

aten = torch.ops.aten


# -- index and the constant indices ---------------------------------------------------------------------

def _indexed(value: torch.Tensor | None, *, where: int, x_shape=(2, 5, 6, 4), lift: str | None = "lift_fresh_copy"):
    """``x[..., idx]`` on dim ``where``, ``idx`` a constant buffer (``value``) read by get_attr (then ``lift``)."""
    root = torch.nn.Module()
    graph = fx.Graph()
    x = _input(graph, x_shape)
    if value is not None:
        root.register_buffer("consts_idx", value)
        idx = graph.get_attr("consts_idx")
        if lift is not None:
            idx = graph.call_function(getattr(aten, lift).default, (idx,))
        set_meta(idx, TENSOR, TensorInfo(tuple(value.shape), value.dtype, 0))
    else:
        idx = _input(graph, (1,))
    out_shape = list(x_shape)
    out_shape[where] = 1
    node = _call(graph, aten.index.Tensor, (x, [None] * where + [idx]), out_shape)
    graph.output(node)
    fx.GraphModule(root, graph)
    return x, idx, node


def test_index_of_another_dim_keeps_the_shard():
    x, _, node = _indexed(torch.tensor([1]), where=1)
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})
    x, _, node = _indexed(torch.tensor([1, 0]), where=3)
    assert _apply(node, {x: S(2, chunks=3)}) == (S(2, chunks=3), {x: S(2, chunks=3)})


def test_index_refuses_a_sharded_index_and_all_but_one_1d_index_tensor():
    x, idx, node = _indexed(None, where=1)
    with pytest.raises(NoRule, match="with a sharded index"):
        _apply(node, {idx: S(0)})
    graph = fx.Graph()
    x, i, j = _input(graph, (2, 5, 8)), _input(graph, (3,)), _input(graph, (3,))
    grid = _input(graph, (3, 2))
    cases = {(None, i, j): (2, 3), (grid,): (3, 2, 5, 8), (None, 3): (2, 8), (None, None): (2, 5, 8)}
    for indices, shape in cases.items():
        node = _call(graph, aten.index.Tensor, (x, list(indices)), shape)
        with pytest.raises(NoRule, match="only one 1-D index tensor"):
            _apply(node, {x: S(0)})


MQA = S(2, blocks=((4, 0), (1, 1), (1, 1)))  # [q (4 heads) | k (1) | v (1)] on the heads dim


@pytest.mark.parametrize("value", [-1, -2])
def test_index_of_a_whole_kv_block_by_a_negative_index_gives_the_head_every_rank_holds(value):
    x, _, node = _indexed(torch.tensor([value]), where=2)
    assert _apply(node, {x: MQA}) == (S(2, parts=1), {x: MQA})


@pytest.mark.parametrize("placed,value,words", [
    (MQA, -3, "block cut over the ranks"), (MQA, -6, "block cut over the ranks"),
    (S(2, blocks=((4, 0), (1, 1), (1, 2))), -2, "block cut over the ranks"),  # a cut block after it
    (MQA, -7, "outside the blocks"), (MQA, 0, "indexes the sharded dim"), (MQA, 5, "indexes the sharded dim"),
    (S(2), -1, "indexes the sharded dim"), (S(2, parts=1), -1, "indexes the sharded dim"),
])
def test_index_of_the_sharded_dim_is_refused_but_for_a_whole_block(placed, value, words):
    x, _, node = _indexed(torch.tensor([value]), where=2)
    with pytest.raises(NoRule, match=words):
        _apply(node, {x: placed})


def test_index_of_a_fused_block_by_a_non_constant_or_many_valued_index_is_refused():
    x, _, node = _indexed(torch.tensor([-1, -2]), where=2)
    with pytest.raises(NoRule, match="indexes the sharded dim"):
        _apply(node, {x: MQA})
    x, _, node = _indexed(None, where=2)
    with pytest.raises(NoRule, match="indexes the sharded dim"):
        _apply(node, {x: MQA})


def test_a_constant_index_is_read_through_a_lift_a_clone_or_a_detach_and_nothing_else():
    for lift in ("lift_fresh_copy", "clone", "detach", None):
        _, idx, _ = _indexed(torch.tensor([3]), where=1, lift=lift)
        assert torch.equal(constant_value(idx), torch.tensor([3]))
    _, idx, _ = _indexed(torch.tensor([3]), where=1, lift="neg")
    assert constant_value(idx) is None
    _, idx, _ = _indexed(None, where=1)
    assert constant_value(idx) is None


def test_a_constant_index_needs_a_module_a_tensor_and_real_values():
    graph = fx.Graph()
    loose = graph.get_attr("consts_idx")
    assert constant_value(loose) is None  # no owning module
    root = torch.nn.Module()
    root.inner = torch.nn.Module()
    root.inner.register_buffer("idx", torch.tensor([-1]))
    root.inner.register_buffer("meta", torch.empty(1, device="meta"))
    root.inner.number = 7
    graph = fx.Graph()
    nested, meta, number = graph.get_attr("inner.idx"), graph.get_attr("inner.meta"), graph.get_attr("inner.number")
    graph.output((nested, meta, number))
    fx.GraphModule(root, graph)
    with pytest.warns(UserWarning, match="no underlying reference"):
        missing = graph.get_attr("inner.missing")
    assert torch.equal(constant_value(nested), torch.tensor([-1]))
    assert constant_value(meta) is None and constant_value(number) is None and constant_value(missing) is None


# -- attention -------------------------------------------------------------------------------------------

def _sdpa(shapes=((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8)), mask=None, *, as_kwarg=False):
    graph = fx.Graph()
    q, k, v = (_input(graph, s) for s in shapes)
    args, kwargs = [q, k, v], {}
    m = None
    if mask is not None:
        m = _input(graph, mask)
        if as_kwarg:
            kwargs["attn_mask"] = m
        else:
            args.append(m)
    node = _call(graph, aten.scaled_dot_product_attention.default, args, shapes[0], **kwargs)
    return (q, k, v, m), node


def test_attention_shards_q_k_and_v_on_their_heads_from_whichever_is_sharded():
    (q, k, v, _), node = _sdpa()
    assert _apply(node, {q: S(1)}) == (S(1), {q: S(1), k: S(1), v: S(1)})
    assert _apply(node, {v: S(1)}) == (S(1), {q: S(1), k: S(1), v: S(1)})
    gqa = S(1, parts=2, inner=2)
    assert _apply(node, {q: S(1), k: S(1), v: S(1)}) == (S(1), {q: S(1), k: S(1), v: S(1)})
    with pytest.raises(NoRule, match="x1 is S.*attention needs heads sharded"):
        _apply(node, {q: S(1), k: gqa})
    with pytest.raises(NoRule, match="x0 is P"):
        _apply(node, {q: P})
    with pytest.raises(NoRule, match="x2 is S"):
        _apply(node, {q: S(1), v: S(2)})


def test_attention_reads_a_single_kv_head_every_rank_holds_whole_beside_query_heads_cut_over_tp():
    whole = S(1, parts=1)
    (q, k, v, _), node = _sdpa(((2, 4, 5, 8), (2, 1, 5, 8), (2, 1, 5, 8)))
    assert _apply(node, {q: S(1), k: whole, v: whole}) == (S(1), {q: S(1), k: whole, v: whole})
    assert _apply(node, {k: whole}) == (S(1), {q: S(1), k: whole, v: S(1)})
    with pytest.raises(NoRule, match="x1 is S"):  # query heads held whole too: no broadcast to read
        _apply(node, {q: S(1, parts=2), k: whole})
    (q, k, v, _), node = _sdpa(((2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)))
    with pytest.raises(NoRule, match="x1 is S"):  # two kv heads are no single head
        _apply(node, {q: S(1), k: whole})
    (q, k, v, _), node = _sdpa(((2, 1, 5, 8), (2, 1, 5, 8), (2, 1, 5, 8)))
    assert _apply(node, {q: whole, k: whole}) == (whole, {q: whole, k: whole, v: whole})


@pytest.mark.parametrize("mask,placed", [((2, 4, 5, 5), S(1)), ((2, 1, 5, 5), R), ((5, 5), R), ((4, 5, 5), S(0)),
                                         ((1, 5, 5), R)])
@pytest.mark.parametrize("as_kwarg", [False, True])
def test_an_attention_mask_is_sharded_on_its_heads_or_read_whole_where_it_broadcasts(mask, placed, as_kwarg):
    (q, k, v, m), node = _sdpa(mask=mask, as_kwarg=as_kwarg)
    assert _apply(node, {q: S(1)}) == (S(1), {q: S(1), k: S(1), v: S(1), m: placed})


def test_an_attention_mask_placed_otherwise_is_refused():
    (q, k, v, m), node = _sdpa(mask=(2, 4, 5, 5))
    with pytest.raises(NoRule, match="needs"):
        _apply(node, {q: S(1), m: S(2)})


def _cp_graph(module):
    root = torch.nn.Module()
    root.attn = module
    graph = fx.Graph()
    q, k, v = (_input(graph, (2, 4, 8, 4)) for _ in range(3))
    node = graph.call_module("attn", (q, k, v))
    set_meta(node, TENSOR, TensorInfo((2, 4, 8, 4), torch.float32, 0))
    graph.output(node)
    fx.GraphModule(root, graph)
    return (q, k, v), node


@pytest.mark.parametrize("kind", [RingAttention, UlyssesAttention])
def test_context_parallel_attention_takes_the_attention_rule(kind):
    (q, k, v), node = _cp_graph(kind(axis="cp", size=2, layout=CpLayout(seq_len=8, cp=2), spec=AttentionSpec(0.5)))
    assert rule_for(node) is tp_rules.sdpa
    assert _apply(node, {k: S(1)}) == (S(1), {q: S(1), k: S(1), v: S(1)})


def test_another_module_call_and_other_node_kinds_have_no_rule():
    _, node = _cp_graph(torch.nn.Identity())
    with pytest.raises(NoRule, match="is a call_module node"):
        rule_for(node)
    graph = fx.Graph()
    x = _input(graph, (2, 4, 8, 4))
    loose = graph.call_module("attn", (x,))  # a graph of no module
    with pytest.raises(NoRule, match="is a call_module node"):
        rule_for(loose)
    with pytest.raises(NoRule, match="is a placeholder node"):
        rule_for(x)
    method = graph.call_method("view", (x, 8, 16))
    with pytest.raises(NoRule, match="is a call_method node"):
        rule_for(method)
    node = graph.call_function(aten.cumsum.default, (x, 1))
    with pytest.raises(NoRule, match="no tensor-parallel rule for op cumsum"):
        rule_for(node)


# -- batched products ------------------------------------------------------------------------------------

def _product(target, *shapes, out):
    graph = fx.Graph()
    inputs = [_input(graph, s) for s in shapes]
    return inputs, _call(graph, target, inputs, out)


def test_matmul_shards_a_batch_dim_of_both_operands_or_reads_a_broadcast_one_whole():
    (a, b), node = _product(aten.matmul.default, (2, 4, 5, 8), (2, 4, 8, 3), out=(2, 4, 5, 3))
    assert _apply(node, {a: S(1)}) == (S(1), {a: S(1), b: S(1)})
    assert _apply(node, {b: S(0)}) == (S(0), {a: S(0), b: S(0)})
    (a, b), node = _product(aten.matmul.default, (2, 4, 5, 8), (8, 3), out=(2, 4, 5, 3))
    assert _apply(node, {a: S(1)}) == (S(1), {a: S(1), b: R})
    (a, b), node = _product(aten.matmul.default, (2, 4, 5, 8), (2, 1, 8, 3), out=(2, 4, 5, 3))
    assert _apply(node, {a: S(1)}) == (S(1), {a: S(1), b: R})
    (a, b), node = _product(aten.matmul.default, (4, 5, 8), (2, 4, 8, 3), out=(2, 4, 5, 3))
    assert _apply(node, {a: S(0)}) == (S(1), {a: S(0), b: S(1)})
    (a, b), node = _product(aten.bmm.default, (4, 5, 8), (4, 8, 3), out=(4, 5, 3))
    assert _apply(node, {b: S(0)}) == (S(0), {a: S(0), b: S(0)})


@pytest.mark.parametrize("dim", [2, 3])
def test_matmul_refuses_a_sharded_matrix_dim(dim):
    (a, b), node = _product(aten.matmul.default, (2, 4, 5, 8), (2, 4, 8, 3), out=(2, 4, 5, 3))
    with pytest.raises(NoRule, match="contracts or keeps a sharded matrix dim"):
        _apply(node, {a: S(dim)})


def test_matmul_refuses_operands_placed_apart():
    (a, b), node = _product(aten.matmul.default, (2, 4, 5, 8), (2, 4, 8, 3), out=(2, 4, 5, 3))
    with pytest.raises(NoRule, match="x1 is S.*needs"):
        _apply(node, {a: S(1), b: S(0)})
    (a, b), node = _product(aten.matmul.default, (2, 4, 5, 8), (2, 1, 8, 3), out=(2, 4, 5, 3))
    with pytest.raises(NoRule, match="x1 is S.*needs R"):
        _apply(node, {a: S(1), b: S(1)})


def test_baddbmm_shards_the_batch_of_its_input_and_both_factors():
    (inp, b1, b2), node = _product(aten.baddbmm.default, (4, 5, 5), (4, 5, 8), (4, 8, 5), out=(4, 5, 5))
    assert _apply(node, {inp: S(0)}) == (S(0), {inp: S(0), b1: S(0), b2: S(0)})
    assert _apply(node, {b2: S(0)}) == (S(0), {inp: S(0), b1: S(0), b2: S(0)})
    (inp, b1, b2), node = _product(aten.baddbmm.default, (1, 5, 5), (4, 5, 8), (4, 8, 5), out=(4, 5, 5))
    assert _apply(node, {b1: S(0)}) == (S(0), {inp: R, b1: S(0), b2: S(0)})
    (inp, b1, b2), node = _product(aten.baddbmm.default, (5, 5), (4, 5, 8), (4, 8, 5), out=(4, 5, 5))
    assert _apply(node, {b1: S(0)}) == (S(0), {inp: R, b1: S(0), b2: S(0)})


@pytest.mark.parametrize("which,dim,words", [(0, 1, "its added input is sharded on a matrix dim"),
                                             (0, 2, "its added input is sharded on a matrix dim"),
                                             (1, 1, "contracts or keeps"), (2, 2, "contracts or keeps"),
                                             (1, 2, "contracts or keeps")])
def test_baddbmm_refuses_a_sharded_matrix_dim(which, dim, words):
    inputs, node = _product(aten.baddbmm.default, (4, 5, 5), (4, 5, 8), (4, 8, 5), out=(4, 5, 5))
    with pytest.raises(NoRule, match=words):
        _apply(node, {inputs[which]: S(dim)})


def test_baddbmm_refuses_inputs_placed_apart():
    (inp, b1, b2), node = _product(aten.baddbmm.default, (4, 5, 5), (4, 5, 8), (4, 8, 5), out=(4, 5, 5))
    with pytest.raises(NoRule, match="x2 is S.*needs"):
        _apply(node, {inp: S(0), b2: S(1)})
    with pytest.raises(NoRule, match=r"x1 is S\(0\), needs S\(0,chunks=2\)"):
        _apply(node, {b1: S(0), inp: S(0, chunks=2)})


# -- export's assertions, op names, the tables -----------------------------------------------------------

def test_an_assertion_gives_nothing_sharded_and_keeps_its_input_as_it_is():
    graph = fx.Graph()
    x = _input(graph, (2, 8))
    node = graph.call_function(aten._assert_tensor_metadata.default, (x,))
    assert _apply(node, {x: S(1, chunks=2)}) == (R, {x: S(1, chunks=2)})
    assert all(RULES[name] is tp_rules.assertion for name in ASSERTIONS)


def test_op_name_is_the_aten_family_or_the_python_name():
    graph = fx.Graph()
    x = _input(graph, (2, 8))
    assert op_name(graph.call_function(operator.getitem, (x, 0))) == "getitem"
    assert op_name(graph.call_function(aten.add.Tensor, (x, x))) == "add"
    assert op_name(graph.call_function(aten.view.default, (x, [16]))) == "view"
    assert op_name(graph.call_function(torch.relu, (x,))) == "relu"
    assert op_name(graph.call_function(operator.add, (x, x))) == "add"

    class Nameless:
        def __call__(self, *args):
            return None

        def __str__(self):
            return "nameless"

    node = graph.call_function(operator.add, (x, x))
    node.target = Nameless()
    assert op_name(node) == "nameless"


def test_every_elementwise_name_takes_the_elementwise_rule():
    assert all(RULES[name] is tp_rules.elementwise for name in ELEMENTWISE) and "add" in ELEMENTWISE
    assert RULES["copy_"] is tp_rules.elementwise and RULES["getitem"] is tp_rules.getitem
