"""The placement rules of the tensor-parallel propagation (passes/tp/tp_rules.py) one at a time, on hand-made
nodes: which dim a sharded input's shard lands on after softmax, a reduction, slice, select and cat, and
which of them refuse. tests/passes/test_tp_refusals.py judges the refusals on models that train wrong
without them; these read the rules' answers where a model would only show a wrong number sometimes."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, Placement, TensorInfo, set_meta
from autopar.passes.tp.tp_rules import NoRule, rule_for, slice_bounds

aten = torch.ops.aten
S2 = Placement.shard(2)  # (batch, seq, features) sharded on its features


def _node(target, in_shape, out_shape, *args, others=()):
    """A call of ``target`` on a placeholder of ``in_shape`` (then ``others``' shapes) giving ``out_shape``."""
    graph = fx.Graph()
    inputs = []
    for i, shape in enumerate((in_shape, *others)):
        x = graph.placeholder(f"x{i}")
        set_meta(x, TENSOR, TensorInfo(tuple(shape), torch.float32, 0))
        inputs.append(x)
    first = inputs if target is aten.cat.default else inputs[:1]
    call_args = (first, *args) if target is aten.cat.default else (*first, *args)
    node = graph.call_function(target, call_args)
    set_meta(node, TENSOR, TensorInfo(tuple(out_shape), torch.float32, 0))
    return inputs, node


def _apply(node, placed):
    return rule_for(node)(node, placed)


@pytest.mark.parametrize("dim", [2, -1])
def test_softmax_over_the_sharded_dim_is_refused_and_over_another_keeps_the_shard(dim):
    (x,), node = _node(aten._softmax.default, (2, 5, 8), (2, 5, 8), dim, False)
    with pytest.raises(NoRule, match="normalises over the sharded dim"):
        _apply(node, {x: S2})
    (x,), node = _node(aten._softmax.default, (2, 5, 8), (2, 5, 8), dim - 1, False)
    assert _apply(node, {x: S2}) == (S2, {x: S2})


@pytest.mark.parametrize("dims,keepdim,out_shape,out_dim", [
    ([1], False, (2, 8), 1), ([-2], False, (2, 8), 1), ([0, 1], False, (8,), 0), ([1], True, (2, 1, 8), 2),
    ([0], True, (1, 5, 8), 2), (1, False, (2, 8), 1),
])
def test_a_reduction_of_other_dims_moves_the_shard_by_the_dims_dropped_before_it(dims, keepdim, out_shape, out_dim):
    (x,), node = _node(aten.amax.default, (2, 5, 8), out_shape, dims, keepdim)
    assert _apply(node, {x: S2}) == (Placement.shard(out_dim), {x: S2})


def test_a_reduction_given_its_dims_alone_drops_them():
    """``amax(x, [1])``, keepdim left to its default: a reduction of dim 1, not of every dim."""
    (x,), node = _node(aten.amax.default, (2, 5, 8), (2, 8), [1])
    assert _apply(node, {x: S2}) == (Placement.shard(1), {x: S2})


def test_a_reduction_after_the_shard_leaves_its_dim():
    (x,), node = _node(aten.amax.default, (2, 8, 5), (2, 8), [2], False)
    assert _apply(node, {x: Placement.shard(1)}) == (Placement.shard(1), {x: Placement.shard(1)})


@pytest.mark.parametrize("args,words", [(([2], True), "reduces over the sharded dim"),
                                        (([-1, 0], False), "reduces over the sharded dim"),
                                        ((), "reduces every dim")])
def test_a_reduction_over_the_sharded_dim_or_every_dim_is_refused(args, words):
    (x,), node = _node(aten.amax.default, (2, 5, 8), (2, 5, 1), *args)
    with pytest.raises(NoRule, match=words):
        _apply(node, {x: S2})


@pytest.mark.parametrize("args,bounds", [
    ((), (0, 0, 4)), ((1,), (1, 0, 6)), ((1, 2), (1, 2, 6)), ((1, 2, 4), (1, 2, 4)), ((1, None, 4), (1, 0, 4)),
    ((1, 2, None), (1, 2, 6)), ((1, -4, -1), (1, 2, 5)), ((-1, 1, 100), (2, 1, 8)), ((1, -100, 3), (1, 0, 3)),
    ((1, 7, 9), (1, 6, 6)), ((1, 0, -100), (1, 0, 0)), ((1, 0, 0), (1, 0, 0)), ((1, -1, 0), (1, 5, 0)),
])
def test_slice_bounds_resolve_pythons_slices(args, bounds):
    _, node = _node(aten.slice.Tensor, (4, 6, 8), (4, 6, 8), *args)
    assert slice_bounds(node) == bounds


def test_a_slice_of_another_dim_keeps_the_shard_and_of_the_sharded_dim_is_refused():
    (x,), node = _node(aten.slice.Tensor, (2, 5, 8), (2, 3, 8), 1, 1, 4)
    assert _apply(node, {x: S2}) == (S2, {x: S2})
    (x,), node = _node(aten.slice.Tensor, (2, 5, 8), (2, 5, 4), 2, 2, 6)
    with pytest.raises(NoRule, match="slices the sharded dim"):
        _apply(node, {x: S2})


def test_a_slice_of_whole_fused_blocks_keeps_them_and_a_strided_one_is_refused():
    fused = Placement.shard(2, blocks=((8, 2), (4, 2), (4, 2)))  # [q | k | v] of 8, 4 and 4 features
    (x,), node = _node(aten.slice.Tensor, (2, 5, 16), (2, 5, 8), 2, 8, 16, 1)
    assert _apply(node, {x: fused}) == (Placement.shard(2, blocks=((4, 2), (4, 2))), {x: fused})
    (x,), node = _node(aten.slice.Tensor, (2, 5, 16), (2, 5, 8), 2, 0, 8)
    assert _apply(node, {x: fused}) == (Placement.shard(2, parts=2), {x: fused})
    (x,), node = _node(aten.slice.Tensor, (2, 5, 16), (2, 5, 4), 2, 8, 16, 2)
    with pytest.raises(NoRule, match="slices the sharded dim"):
        _apply(node, {x: fused})


@pytest.mark.parametrize("dim,placed,out", [(1, S2, Placement.shard(1)), (0, S2, Placement.shard(1)),
                                            (-2, S2, Placement.shard(1)),
                                            (2, Placement.shard(1), Placement.shard(1))])
def test_select_drops_a_dim_before_the_shard_or_after_it(dim, placed, out):
    (x,), node = _node(aten.select.int, (2, 5, 8), (2, 8), dim, 0)
    assert _apply(node, {x: placed}) == (out, {x: placed})


@pytest.mark.parametrize("dim", [2, -1])
def test_select_along_the_sharded_dim_is_refused(dim):
    (x,), node = _node(aten.select.int, (2, 5, 8), (2, 5), dim, 0)
    with pytest.raises(NoRule, match="selects along the sharded dim"):
        _apply(node, {x: S2})


def test_cat_along_another_dim_shards_every_input_alike():
    (x, y), node = _node(aten.cat.default, (2, 5, 8), (2, 10, 8), 1, others=[(2, 5, 8)])
    assert _apply(node, {x: S2}) == (S2, {x: S2, y: S2})
    (x, y), node = _node(aten.cat.default, (2, 5, 8), (2, 10, 8), -2, others=[(2, 5, 8)])
    assert _apply(node, {x: S2, y: S2}) == (S2, {x: S2, y: S2})


@pytest.mark.parametrize("dim", [2, -1])
def test_cat_along_the_sharded_dim_is_refused(dim):
    (x, y), node = _node(aten.cat.default, (2, 5, 8), (2, 5, 16), dim, others=[(2, 5, 8)])
    with pytest.raises(NoRule, match="concatenates along the sharded dim"):
        _apply(node, {x: S2})


def test_cat_of_an_input_sharded_otherwise_is_refused():
    (x, y), node = _node(aten.cat.default, (2, 5, 8), (2, 10, 8), 1, others=[(2, 5, 8)])
    with pytest.raises(NoRule, match="needs"):
        _apply(node, {x: S2, y: Placement.shard(0)})


def test_cat_without_a_dim_joins_dim_0():
    (x, y), node = _node(aten.cat.default, (8, 5), (16, 5), others=[(8, 5)])
    with pytest.raises(NoRule, match="concatenates along the sharded dim"):
        _apply(node, {x: Placement.shard(0)})
    assert _apply(node, {x: Placement.shard(1)}) == (Placement.shard(1), {x: Placement.shard(1), y: Placement.shard(1)})


def test_a_view_into_heads_counts_each_fused_block_in_heads_and_one_that_cuts_a_block_is_refused():
    """[q | k | v] of 8, 4 and 4 features viewed as 4 heads of 4: blocks of 2, 1 and 1 heads; 6, 6 and 4
    features would cut a head across q and k."""
    (x,), node = _node(aten.view.default, (2, 5, 16), (2, 5, 4, 4), [2, 5, 4, 4])
    fused = Placement.shard(2, blocks=((8, 2), (4, 2), (4, 2)))
    out, need = _apply(node, {x: fused})
    assert (out, need) == (Placement.shard(2, blocks=((2, 2), (1, 2), (1, 2))), {x: fused})
    with pytest.raises(NoRule, match="cuts inside a block"):
        _apply(node, {x: Placement.shard(2, blocks=((6, 2), (6, 2), (4, 2)))})
