"""The placement rules of the tensor-parallel propagation (passes/tp/tp_rules.py) that move a shard between dims:
views (``view_dim_map``, the kv-head merges, the fused blocks), expand, unsqueeze, transpose, permute, ``.T``,
the complex views, split and its pieces, stack, and the broadcasting of element-wise ops. Each case calls one
rule on hand-made nodes and pins the exact placement it returns and the placements it asks of its inputs,
where a wrong dim, chunk count or broadcast would only show on some model's shapes
(tests/passes/test_tp_rules_units.py does the same for softmax, the reductions, slice, select and cat)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, TensorInfo, set_meta
from autopar.passes.tp import tp_rules
from autopar.passes.tp.tp_rules import NoRule, view_dim_map

from tp_rule_nodes import P, R, S, apply_rule as _apply, make_call as _call, make_input as _input

aten = torch.ops.aten


def _one(target, in_shape, out_shape, *args, **kwargs):
    """``target(x, *args)`` on an input of ``in_shape`` giving ``out_shape``: (x, node)."""
    graph = fx.Graph()
    x = _input(graph, in_shape)
    return x, _call(graph, target, (x, *args), out_shape, **kwargs)


# -- the helpers every rule reads ------------------------------------------------------------------------

def test_shape_of_refuses_a_value_without_a_recorded_shape():
    graph = fx.Graph()
    bare, unknown = _input(graph, None), graph.placeholder("unknown")
    set_meta(unknown, TENSOR, TensorInfo(None, None, 0))
    for value in (bare, unknown, 3):
        with pytest.raises(NoRule, match="no shape recorded"):
            tp_rules.shape_of(value)
    assert tp_rules.shape_of(_input(graph, (2, 3))) == (2, 3)


def test_the_tensor_args_are_the_nodes_with_a_shape_in_args_lists_and_kwargs_in_order():
    graph = fx.Graph()
    x, y, z = _input(graph, (2, 8)), _input(graph, (8,)), _input(graph, (2, 8))
    bare, unknown = _input(graph, None), graph.placeholder("unknown")
    set_meta(unknown, TENSOR, TensorInfo(None, None, 0))
    node = _call(graph, aten.add.Tensor, (x, [bare, y, 3], (unknown,), "s"), (2, 8), other=z)
    assert tp_rules._tensor_args(node) == [x, y, z]


def test_the_anchor_is_the_first_sharded_tensor_input():
    graph = fx.Graph()
    x, y = _input(graph, (2, 8)), _input(graph, (2, 8))
    node = _call(graph, aten.add.Tensor, (x, y), (2, 8))
    assert tp_rules._anchor(node, {y: S(1)}) == (y, S(1))
    assert tp_rules._anchor(node, {x: S(0), y: S(1)}) == (x, S(0))
    with pytest.raises(NoRule, match="has no sharded input"):
        tp_rules._anchor(node, {})


def test_a_moved_shard_keeps_its_ways_and_drops_its_inner_dim():
    gqa = S(1, parts=2, inner=2)
    assert tp_rules._S(gqa, 3) == S(3, parts=2)
    assert tp_rules._S(S(2, chunks=3), 1) == S(1, chunks=3)
    assert tp_rules._S(S(2, chunks=3), 1, 1) == S(1)
    assert tp_rules._norm(0, 3) == 0 and tp_rules._norm(-1, 3) == 2 and tp_rules._norm(-3, 3) == 0


# -- element-wise ops and their broadcasting -----------------------------------------------------------

def test_an_elementwise_op_shards_each_input_on_its_right_aligned_dim_and_leaves_broadcast_ones_whole():
    graph = fx.Graph()
    x, bias, col, row, scalar = (_input(graph, s) for s in ((2, 5, 8), (8,), (2, 5, 1), (1, 5, 8), (1,)))
    node = _call(graph, aten.add.Tensor, (x, bias), (2, 5, 8))
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2), bias: S(0)})
    assert _apply(node, {bias: S(0)}) == (S(2), {x: S(2), bias: S(0)})  # the lower-rank input is the anchor
    node = _call(graph, aten.mul.Tensor, (x, col), (2, 5, 8))
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2), col: R})
    assert _apply(node, {x: S(0)}) == (S(0), {x: S(0), col: S(0)})
    node = _call(graph, aten.mul.Tensor, (x, row), (2, 5, 8))
    assert _apply(node, {x: S(0)}) == (S(0), {x: S(0), row: R})
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1), row: S(1)})
    node = _call(graph, aten.mul.Tensor, (x, scalar), (2, 5, 8))
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1), scalar: R})


def test_an_elementwise_op_refuses_an_input_placed_otherwise_and_a_partial_anchor():
    graph = fx.Graph()
    x, y, col = _input(graph, (2, 5, 8)), _input(graph, (2, 5, 8)), _input(graph, (2, 5, 1))
    node = _call(graph, aten.add.Tensor, (x, y), (2, 5, 8))
    with pytest.raises(NoRule, match=r"input x1 is S\(.*\), needs"):
        _apply(node, {x: S(2), y: S(1)})
    with pytest.raises(NoRule, match="input x0 is P"):
        _apply(node, {x: P})
    node = _call(graph, aten.add.Tensor, (x, col), (2, 5, 8))
    with pytest.raises(NoRule, match="needs R"):
        _apply(node, {x: S(2), col: S(2)})


def test_an_elementwise_op_reads_a_partial_mean_replicated_but_no_other_partial_value():
    """``x - x.mean(-1, keepdim=True)`` on the shards: the mean is all-reduced, then read whole."""
    graph = fx.Graph()
    x = _input(graph, (2, 5, 8))
    mean = _call(graph, aten.mean.dim, (x, [-1], True), (2, 5, 1))
    other = _call(graph, aten.amax.default, (x, [-1], True), (2, 5, 1))
    node = _call(graph, aten.sub.Tensor, (x, mean), (2, 5, 8))
    assert _apply(node, {x: S(2), mean: P}) == (S(2), {x: S(2), mean: R})
    node = _call(graph, aten.sub.Tensor, (x, other), (2, 5, 8))
    with pytest.raises(NoRule, match="is P, needs R"):
        _apply(node, {x: S(2), other: P})


def test_a_single_kv_head_every_rank_holds_whole_keeps_its_size_one_heads_dim():
    """k ``[B, 1, L, D]`` placed S(1, parts=1) (every rank the one head) times a mask of the same shape."""
    whole = S(1, parts=1)
    graph = fx.Graph()
    k, m = _input(graph, (2, 1, 5, 4)), _input(graph, (2, 1, 5, 4))
    node = _call(graph, aten.mul.Tensor, (k, m), (2, 1, 5, 4))
    assert _apply(node, {k: whole, m: whole}) == (whole, {k: whole, m: whole})
    assert _apply(node, {k: whole}) == (whole, {k: whole, m: R})
    cut = S(1, parts=2)  # two ranks' pieces of one head: no exception
    with pytest.raises(NoRule, match="needs R"):
        _apply(node, {k: cut, m: cut})


# -- view_dim_map and the views ------------------------------------------------------------------------

@pytest.mark.parametrize("in_shape,out_shape,dim,chunks,found", [
    ((2, 5, 8), (2, 5, 2, 4), 2, 1, (2, 1)),  # heads split off the features: the shard on the heads
    ((2, 5, 8), (10, 8), 2, 1, (1, 1)),
    ((2, 5, 8), (10, 8), 0, 1, (0, 1)),  # a merge keeps the outer dim's shard outermost
    ((2, 5, 2, 4), (2, 5, 8), 2, 1, (2, 1)),  # the heads merged back into the features
    ((2, 4), (8,), 1, 1, (0, 2)),  # the inner dim of a merge: 2 blocks of the merged dim
    ((1, 4), (2, 2), 1, 1, (0, 1)),  # a size-1 dim before the shard is no block
    ((8,), (1, 8), 0, 1, (1, 1)),  # a size-1 dim of the output holds nothing
    ((2, 5, 24), (2, 5, 3, 8), 2, 3, (3, 1)),  # [q | k | v] into its 3 blocks: each block cut
    ((2, 5, 24), (2, 5, 6, 4), 2, 3, (2, 3)),  # into 6 heads: the heads dim holds the 3 chunks
    ((2, 5, 24), (2, 5, 12, 2), 2, 3, (2, 3)),
    ((2, 5, 24), (2, 5, 24, 1), 2, 3, (2, 3)),
    ((6, 1, 4), (6, 4), 2, 1, (1, 1)),
    ((6, 4, 1), (6, 4), 1, 1, (1, 1)),
    ((4, 6), (2, 2, 6), 0, 1, (0, 1)),
    ((4, 6), (2, 2, 6), 1, 1, (2, 1)),
])
def test_view_dim_map_finds_where_the_shard_lands(in_shape, out_shape, dim, chunks, found):
    result = view_dim_map(in_shape, out_shape, dim, chunks)
    assert result == found and all(type(n) is int for n in result)  # chunks feed sizes: 3.0 is no size


@pytest.mark.parametrize("in_shape,out_shape,dim,chunks,words", [
    ((2, 4), (4, 2), 1, 1, "not outermost"),  # the inner dim of a many-to-many regroup
    ((2, 5, 24), (2, 5, 4, 6), 2, 3, "does not fit"),  # 3 chunks over 4 heads
    ((2, 5, 24), (2, 5, 2, 12), 2, 3, "does not fit"),
    ((4, 8, 1), (4, 8), 2, 1, "vanishes"),
    ((4, 8), (32,), 5, 1, "not found"),
    ((4,), (4, 1), 3, 1, "not found"),
    ((4, 8), (32,), 2, 1, "not found"),  # one past the last dim: no group holds it  # the input's dims run out first: the rest are size 1
])
def test_view_dim_map_refuses_a_shard_a_view_cannot_keep(in_shape, out_shape, dim, chunks, words):
    with pytest.raises(NoRule, match=words):
        view_dim_map(in_shape, out_shape, dim, chunks)


@pytest.mark.parametrize("target,args", [(aten.view.default, ([2, 5, 2, 4],)), (aten.reshape.default, ([2, 5, 2, 4],)),
                                         (aten._unsafe_view.default, ([2, 5, 2, 4],)),
                                         (aten.unflatten.int, (2, [2, 4]))])
def test_a_view_into_heads_shards_the_heads(target, args):
    x, node = _one(target, (2, 5, 8), (2, 5, 2, 4), *args)
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1)})
    x, node = _one(aten.flatten.using_ints, (2, 5, 2, 4), (2, 5, 8), 2)
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})


def test_a_view_of_fused_chunks_into_heads_keeps_the_chunks_on_the_heads():
    x, node = _one(aten.view.default, (2, 5, 24), (2, 5, 6, 4), [2, 5, 6, 4])
    assert _apply(node, {x: S(2, chunks=3)}) == (S(2, chunks=3), {x: S(2, chunks=3)})
    x, node = _one(aten.view.default, (2, 5, 24), (2, 5, 3, 8), [2, 5, 3, 8])
    assert _apply(node, {x: S(2, chunks=3)}) == (S(3), {x: S(2, chunks=3)})


def test_a_view_of_fused_blocks_refuses_to_merge_them_and_moves_them_to_the_heads():
    fused = S(2, blocks=((8, 2), (4, 2), (4, 2)))
    x, node = _one(aten.view.default, (2, 5, 16), (10, 16), [10, 16])
    assert _apply(node, {x: fused}) == (S(1, blocks=((8, 2), (4, 2), (4, 2))), {x: fused})
    x, node = _one(aten.view.default, (2, 5, 16), (2, 80), [2, 80])
    with pytest.raises(NoRule, match="merges the blocks"):
        _apply(node, {x: fused})
    fused0 = S(1, blocks=((8, 2), (4, 2), (4, 2)))
    x, node = _one(aten.view.default, (5, 16, 3), (5, 3, 16), [5, 3, 16])
    with pytest.raises(NoRule, match="merges the blocks"):
        _apply(node, {x: fused0})
    x, node = _one(aten.view.default, (5, 16, 3), (5, 4, 12), [5, 4, 12])  # 4 rows of 16 in each of 4
    assert _apply(node, {x: fused0}) == (S(1, blocks=((2, 2), (1, 2), (1, 2))), {x: fused0})
    x, node = _one(aten.view.default, (2, 5, 16), (2, 5, 8, 2), [2, 5, 8, 2])
    assert _apply(node, {x: fused}) == (S(2, blocks=((4, 2), (2, 2), (2, 2))), {x: fused})


def test_a_view_of_a_single_kv_head_follows_its_size_one_dim():
    whole = S(1, parts=1)
    x, node = _one(aten.view.default, (2, 1, 5, 4), (2, 1, 20), [2, 1, 20])
    assert _apply(node, {x: whole}) == (whole, {x: whole})
    x, node = _one(aten.view.default, (2, 1, 5, 4), (2, 5, 1, 4), [2, 5, 1, 4])
    with pytest.raises(NoRule, match="drops the heads dim"):
        _apply(node, {x: whole})
    x, node = _one(aten.view.default, (2, 1, 5, 4), (2, 20), [2, 20])
    with pytest.raises(NoRule, match="drops the heads dim"):
        _apply(node, {x: whole})
    x, node = _one(aten.view.default, (2, 5, 1, 4), (10, 1, 4), [10, 1, 4])
    assert _apply(node, {x: S(2, parts=1)}) == (S(1, parts=1), {x: S(2, parts=1)})
    x, node = _one(aten.view.default, (1, 5, 4), (1, 1, 20), [1, 1, 20])
    assert _apply(node, {x: S(0, parts=1)}) == (S(0, parts=1), {x: S(0, parts=1)})


def test_a_view_of_a_dim_every_rank_holds_whole_moves_to_a_size_one_dim_before_it():
    """A value held whole (parts 1) on a dim > 1 viewed with a size-1 dim in front: the size-1 dim carries it
    (its heads dim); cut over the ranks (parts 0) it stays on the dim itself."""
    x, node = _one(aten.view.default, (2, 5, 16), (2, 5, 1, 16), [2, 5, 1, 16])
    assert _apply(node, {x: S(2, parts=1)}) == (S(2, parts=1), {x: S(2, parts=1)})
    assert _apply(node, {x: S(2)}) == (S(3), {x: S(2)})
    x, node = _one(aten.view.default, (2, 5, 16), (2, 5, 1, 1, 16), [2, 5, 1, 1, 16])
    assert _apply(node, {x: S(2, parts=1)}) == (S(2, parts=1), {x: S(2, parts=1)})
    x, node = _one(aten.view.default, (2, 5, 16), (10, 1, 16), [10, 1, 16])
    assert _apply(node, {x: S(2, parts=1)}) == (S(1, parts=1), {x: S(2, parts=1)})
    x, node = _one(aten.view.default, (2, 5, 16), (1, 10, 16), [1, 10, 16])  # the 1 is not next to it
    assert _apply(node, {x: S(2, parts=1)}) == (S(2, parts=1), {x: S(2, parts=1)})
    x, node = _one(aten.view.default, (2, 5, 16), (2, 1, 5, 16), [2, 1, 5, 16])
    assert _apply(node, {x: S(2, parts=1)}) == (S(3, parts=1), {x: S(2, parts=1)})
    x, node = _one(aten.view.default, (16, 5), (1, 16, 5), [1, 16, 5])
    assert _apply(node, {x: S(0, parts=1)}) == (S(0, parts=1), {x: S(0, parts=1)})


def test_a_view_merging_kv_heads_cut_parts_ways_with_the_next_dim_cuts_the_merged_dim():
    """Falcon: 2 kv groups cut 2 ways, 4 query heads each, merged to 8 heads: S(1) on the merged dim."""
    groups = S(1, parts=2)
    x, node = _one(aten.view.default, (3, 2, 4, 5, 6), (3, 8, 5, 6), [3, 8, 5, 6])
    assert _apply(node, {x: groups}) == (S(1), {x: groups})
    one_group = S(1, parts=1)
    x, node = _one(aten.view.default, (3, 1, 4, 5, 6), (3, 4, 5, 6), [3, 4, 5, 6])
    assert _apply(node, {x: one_group}) == (S(1), {x: one_group})


@pytest.mark.parametrize("placement,in_shape,out_shape,refined", [
    (S(1, parts=2), (3, 2, 4, 5), (3, 8, 5), True),
    (S(1, parts=1), (3, 1, 4, 5), (3, 4, 5), True),
    (S(1, parts=1), (3, 2, 4, 5), (3, 8, 5), False),  # whole on every rank and more than one group
    (S(1), (3, 2, 4, 5), (3, 8, 5), False),  # cut tp ways already
    (S(1, chunks=2, parts=2), (3, 2, 4, 5), (3, 8, 5), False),
    (S(1, blocks=((2, 2),)), (3, 2, 4, 5), (3, 8, 5), False),
    (S(1, parts=2, inner=2), (3, 2, 4, 5), (3, 8, 5), False),
    (S(1, parts=2), (3, 2, 1, 5), (3, 2, 5), False),  # nothing to merge with
    (S(2, parts=2), (3, 5, 2), (3, 10), False),  # the last dim
    (S(1, parts=2), (3, 2, 4, 5), (1, 3, 8, 5), False),  # the dims before change
    (S(1, parts=2), (3, 2, 4, 5), (3, 4, 2, 5), False),  # not merged
    (S(1, parts=2), (3, 2, 4, 5), (3, 8, 5, 1), False),  # the dims after change
    (S(1, parts=2), (3, 2, 4), (3, 8), True),
    (S(1, parts=2), (3, 2, 2, 5), (3, 4, 5), True),  # two query heads per group
    (S(0, parts=2), (2, 4, 5), (8, 5), True),
])
def test_refines_is_a_merge_of_kv_groups_with_the_dim_after_them(placement, in_shape, out_shape, refined):
    x, node = _one(aten.view.default, in_shape, out_shape, list(out_shape))
    assert tp_rules.refines(x, node, placement) is refined


def test_a_view_of_kv_heads_broadcast_to_their_query_heads_merges_them_into_one_heads_dim():
    gqa = S(1, parts=2, inner=2)
    x, node = _one(aten.view.default, (3, 2, 4, 5, 6), (3, 8, 5, 6), [3, 8, 5, 6])
    assert _apply(node, {x: gqa}) == (S(1), {x: gqa})
    x, node = _one(aten.view.default, (2, 4, 5), (8, 5), [8, 5])
    assert _apply(node, {x: S(0, parts=2, inner=1)}) == (S(0), {x: S(0, parts=2, inner=1)})
    for out_shape in ((3, 2, 20, 6), (1, 3, 8, 5, 6), (3, 8, 30), (24, 5, 6), (3, 8, 6, 5)):
        x, node = _one(aten.view.default, (3, 2, 4, 5, 6), out_shape, list(out_shape))
        with pytest.raises(NoRule, match="does not merge the kv heads"):
            _apply(node, {x: gqa})
    x, node = _one(aten.view.default, (2, 3, 2, 4, 5), (3, 2, 8, 5), [3, 2, 8, 5])  # the dims before regrouped
    with pytest.raises(NoRule, match="does not merge the kv heads"):
        _apply(node, {x: S(2, parts=2, inner=3)})
    x, node = _one(aten.view.default, (3, 1, 1), (3,), [3])  # no heads dim left to merge into
    with pytest.raises(NoRule, match="does not merge the kv heads"):
        _apply(node, {x: S(1, parts=1, inner=2)})
    x, node = _one(aten.view.default, (3, 2, 4, 5, 6), (3, 8, 5, 6), [3, 8, 5, 6])
    with pytest.raises(NoRule, match="merged with the dim after it"):
        _apply(node, {x: S(1, parts=2, inner=3)})
    with pytest.raises(NoRule, match="merged with the dim after it"):
        _apply(node, {x: S(1, chunks=2, parts=2, inner=2)})


# -- expand --------------------------------------------------------------------------------------------

def test_expand_keeps_a_shard_it_does_not_broadcast_and_refuses_one_it_does():
    x, node = _one(aten.expand.default, (5, 8), (2, 5, 8), [2, 5, 8])
    assert _apply(node, {x: S(1)}) == (S(2), {x: S(1)})
    assert _apply(node, {x: S(0)}) == (S(1), {x: S(0)})
    x, node = _one(aten.broadcast_to.default, (1, 8), (4, 8), [4, 8])
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1)})
    with pytest.raises(NoRule, match="broadcasts the sharded dim"):
        _apply(node, {x: S(0)})


def test_expand_of_kv_heads_cut_parts_ways_to_their_query_heads_cuts_those_the_rest_of_the_ways():
    """transformers' repeat_kv: ``[B, kv, 1, L, D]`` expanded to ``[B, kv, rep, L, D]``."""
    x, node = _one(aten.expand.default, (3, 2, 1, 5, 6), (3, 2, 4, 5, 6), [3, 2, 4, 5, 6])
    assert _apply(node, {x: S(1, parts=2)}) == (S(1, parts=2, inner=2), {x: S(1, parts=2)})
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1)})  # kv heads cut tp ways: each rank its own
    x, node = _one(aten.expand.default, (2, 1, 5, 6), (7, 2, 4, 5, 6), [7, 2, 4, 5, 6])
    assert _apply(node, {x: S(0, parts=2)}) == (S(1, parts=2, inner=2), {x: S(0, parts=2)})
    x, node = _one(aten.expand.default, (2, 1, 5, 6), (1, 2, 4, 5, 6), [1, 2, 4, 5, 6])
    assert _apply(node, {x: S(0, parts=2)}) == (S(1, parts=2, inner=2), {x: S(0, parts=2)})
    x, node = _one(aten.expand.default, (3, 4, 1, 5, 6), (3, 4, 2, 5, 6), [3, 4, 2, 5, 6])
    with pytest.raises(NoRule, match="4 kv heads cut 2 ways"):
        _apply(node, {x: S(1, parts=2)})
    x, node = _one(aten.expand.default, (3, 2, 1, 5, 6), (3, 2, 1, 5, 6), [3, 2, 1, 5, 6])
    assert _apply(node, {x: S(1, parts=2)}) == (S(1, parts=2), {x: S(1, parts=2)})
    x, node = _one(aten.expand.default, (3, 2), (4, 3, 2), [4, 3, 2])
    assert _apply(node, {x: S(1, parts=2)}) == (S(2, parts=2), {x: S(1, parts=2)})


def test_expand_of_a_single_kv_head_every_rank_holds_cuts_its_query_heads_over_tp():
    whole = S(1, parts=1)
    x, node = _one(aten.expand.default, (3, 1, 1, 5, 6), (3, 1, 4, 5, 6), [3, 1, 4, 5, 6])
    assert _apply(node, {x: whole}) == (S(1, parts=1, inner=2), {x: whole})


# -- unsqueeze, transpose, permute, .T, complex views --------------------------------------------------

@pytest.mark.parametrize("dim,out", [(0, 2), (1, 2), (2, 1), (-1, 1), (-2, 2), (-3, 2)])
def test_unsqueeze_moves_the_shard_past_a_new_dim_before_it(dim, out):
    x, node = _one(aten.unsqueeze.default, (4, 8), (4, 1, 8), dim)
    assert _apply(node, {x: S(1)}) == (S(out), {x: S(1)})


@pytest.mark.parametrize("dims,placed,out", [((1, 2), 1, 2), ((1, 2), 2, 1), ((2, 1), 1, 2), ((0, 1), 2, 2),
                                             ((-1, -2), 2, 1), ((-3, 2), 0, 2), ((0, -1), 1, 1)])
def test_transpose_swaps_the_shard_with_the_other_dim(dims, placed, out):
    x, node = _one(aten.transpose.int, (2, 5, 8), (2, 8, 5), *dims)
    assert _apply(node, {x: S(placed, chunks=3)}) == (S(out, chunks=3), {x: S(placed, chunks=3)})


@pytest.mark.parametrize("dims,placed,out", [([0, 2, 1, 3], 1, 2), ([0, 2, 1, 3], 3, 3), ([3, 2, 1, 0], 0, 3),
                                             ([0, -2, -3, -1], 1, 2), ([-1, 0, 1, 2], 3, 0)])
def test_permute_puts_the_shard_where_its_dim_goes(dims, placed, out):
    x, node = _one(aten.permute.default, (2, 5, 4, 8), (2, 4, 5, 8), dims)
    assert _apply(node, {x: S(placed)}) == (S(out), {x: S(placed)})


def test_numpy_T_reverses_the_dims():
    x, node = _one(aten.numpy_T.default, (2, 5, 8), (8, 5, 2))
    assert _apply(node, {x: S(0)}) == (S(2), {x: S(0)})
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1)})


def test_t_swaps_the_two_dims_of_a_2d_value_and_leaves_a_1d_one_as_it_is():
    """``t`` has no dims in its arguments (the rule of ``transpose`` read them: an IndexError)."""
    x, node = _one(aten.t.default, (4, 8), (8, 4))
    assert _apply(node, {x: S(1)}) == (S(0), {x: S(1)})
    assert _apply(node, {x: S(0, chunks=2)}) == (S(1, chunks=2), {x: S(0, chunks=2)})
    x, node = _one(aten.t.default, (8,), (8,))
    assert _apply(node, {x: S(0)}) == (S(0), {x: S(0)})


def test_the_complex_views_keep_the_shard_unless_it_is_the_pair_dim():
    x, node = _one(aten.view_as_complex.default, (2, 5, 4, 2), (2, 5, 4))
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})
    with pytest.raises(NoRule, match="pairs the sharded dim"):
        _apply(node, {x: S(3)})
    x, node = _one(aten.view_as_real.default, (2, 5, 4), (2, 5, 4, 2))
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})


# -- split, chunk and their pieces; stack ---------------------------------------------------------------

def test_a_split_of_another_dim_keeps_the_shard():
    x, node = _one(aten.split.Tensor, (2, 6, 24), None, 2, 1)
    assert _apply(node, {x: S(2, chunks=3)}) == (S(2, chunks=3), {x: S(2, chunks=3)})
    x, node = _one(aten.split.Tensor, (2, 6, 24), None, 2, dim=-2)
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})
    x, node = _one(aten.split.Tensor, (2, 6, 24), None, 1)  # dim 0 by default
    assert _apply(node, {x: S(2)}) == (S(2), {x: S(2)})
    with pytest.raises(NoRule, match="splits the sharded dim"):
        _apply(node, {x: S(0)})


def test_chunk_without_a_dim_chunks_dim_0():
    x, node = _one(aten.chunk.default, (24, 5), None, 3)
    assert _apply(node, {x: S(0, chunks=3)}) == (S(0), {x: S(0, chunks=3)})


@pytest.mark.parametrize("target,args", [(aten.chunk.default, (3, 2)), (aten.chunk.default, (3, -1)),
                                         (aten.split.Tensor, (8, 2)), (aten.split_with_sizes.default, ([8, 8, 8], 2))])
def test_a_split_of_fused_chunks_into_as_many_equal_pieces_gives_each_one_block(target, args):
    x, node = _one(target, (2, 5, 24), None, *args)
    assert _apply(node, {x: S(2, chunks=3)}) == (S(2), {x: S(2, chunks=3)})


@pytest.mark.parametrize("target,args,words", [
    (aten.chunk.default, (2, 2), "into 2 parts, shard has 3"), (aten.chunk.default, (4, 2), "into 4 parts"),
    (aten.split.Tensor, (6, 2), "into 4 parts"), (aten.split.Tensor, (12, 2), "into 2 parts"),
    (aten.split.Tensor, (10, 2), "into 3 parts"),  # 10, 10 and 4: three pieces, not three blocks
    (aten.split.Tensor, (9, 2), "into 3 parts"),
    (aten.split_with_sizes.default, ([8, 16], 2), "into 2 parts"),
    (aten.split_with_sizes.default, ([4, 8, 12], 2), "into 3 parts"),
])
def test_a_split_of_the_sharded_dim_into_other_pieces_is_refused(target, args, words):
    x, node = _one(target, (2, 5, 24), None, *args)
    with pytest.raises(NoRule, match=words):
        _apply(node, {x: S(2, chunks=3)})


def test_a_split_of_fused_blocks_along_them_keeps_them_and_each_piece_holds_its_blocks():
    fused = S(2, blocks=((8, 2), (4, 1), (4, 1)))
    graph = fx.Graph()
    x = _input(graph, (2, 5, 16))
    node = _call(graph, aten.split_with_sizes.default, (x, [8, 4, 4], 2), None)
    assert _apply(node, {x: fused}) == (fused, {x: fused})
    q = _call(graph, operator.getitem, (node, 0), (2, 5, 8))
    k = _call(graph, operator.getitem, (node, 1), (2, 5, 4))
    assert _apply(q, {node: fused}) == (S(2, parts=2), {node: fused})
    assert _apply(k, {node: fused}) == (S(2, parts=1), {node: fused})
    plain = _call(graph, operator.getitem, (node, 0), (2, 5, 8))
    assert _apply(plain, {node: S(2)}) == (S(2), {node: S(2)})  # a split's piece keeps its placement
    with pytest.raises(NoRule, match="indexes an unsharded value"):
        _apply(plain, {x: S(2)})
    node = _call(graph, aten.split_with_sizes.default, (x, [6, 6, 4], 2), None)
    with pytest.raises(NoRule, match="cuts across the blocks"):
        _apply(node, {x: fused})
    node = _call(graph, aten.split.Tensor, (x, 8, 2), None)
    with pytest.raises(NoRule, match="into equal pieces"):
        _apply(node, {x: fused})


@pytest.mark.parametrize("dim,out", [(0, 2), (1, 2), (2, 1), (-1, 1), (-2, 2), (-3, 2)])
def test_stack_moves_the_shard_past_the_new_dim_and_shards_every_input_alike(dim, out):
    graph = fx.Graph()
    x, y = _input(graph, (4, 8)), _input(graph, (4, 8))
    node = _call(graph, aten.stack.default, ([x, y], dim), (2, 4, 8))
    assert _apply(node, {y: S(1)}) == (S(out), {x: S(1), y: S(1)})


def test_stack_without_a_dim_stacks_on_dim_0_and_refuses_inputs_placed_otherwise():
    graph = fx.Graph()
    x, y = _input(graph, (4, 8)), _input(graph, (4, 8))
    node = _call(graph, aten.stack.default, ([x, y],), (2, 4, 8))
    assert _apply(node, {x: S(0)}) == (S(1), {x: S(0), y: S(0)})
    node = _call(graph, aten.stack.default, ([x, y],), (4, 8, 2), dim=2)
    assert _apply(node, {x: S(1)}) == (S(1), {x: S(1), y: S(1)})
    with pytest.raises(NoRule, match="x1 is S.*needs"):
        _apply(node, {x: S(1), y: S(0)})
