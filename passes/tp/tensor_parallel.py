"""Tensor-parallel transform: shard the regions' weights and insert Megatron's f and g.

For each region found by :func:`autopar.passes.tp.tp_regions.find_tp_regions` (chosen by
:func:`autopar.passes.tp.tp_select.select_tp_regions`, the analysis pass before this one):
column linears read their input through a :class:`TpCopy` (f: identity forward, all-reduce
backward) and hold the output-dim shard of weight and bias; row linears hold the input-dim
shard of the weight, their output goes through a :class:`TpReduce` (g: all-reduce forward) and
the bias is added after it. Sizes baked into views inside the region are rewritten to the
local shard's. A transformer block therefore holds 2 forward and 2 backward all-reduces.

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> from autopar.passes.frontend.annotate import annotate
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.passes.tp.tp_select import select_tp_regions
    >>> from autopar.plan_model import MeshShape
    >>> st = shard_tensor_parallel(select_tp_regions(LoweringState.of_graph(gm, mesh=MeshShape(tp=2))))
    >>> st.specs["model.blocks.0.mlp.fc.weight"]
    ShardLayout(dim=0)
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import replace

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import ShardingError
from autopar.ir.meta_keys import MODULE, TENSOR, TP_PLACEMENT, Placement, get_meta, set_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.ops.collectives import TpCopy, TpReduce
from autopar.ops.tp_ops import TpGradSum, TpGroupGradSum, local_shard
from autopar.passes.lowering_state import LoweringState
from autopar.passes.tp.tp_fused_blocks import local_split_sizes
from autopar.passes.tp.tp_gather_output import column_input, insert_output_gathers
from autopar.passes.tp.tp_inplace_rules import ALLOCATIONS
from autopar.passes.tp.tp_reduce_rules import insert_partial_sums
from autopar.passes.tp.tp_regions import TpRegion, fits, projection_of
from autopar.passes.tp.tp_rules import ASSERTIONS, REPLICATE, op_name, refines, shape_of, slice_bounds

__all__ = ["shard_tensor_parallel", "set_param", "localize_sizes", "node_where", "insert_local_slices",
           "cut_kwargs"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


def set_param(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    """Replace the attribute ``target`` (a dotted path) by ``value`` as a Parameter."""
    owner_path, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    old = getattr(owner, leaf)
    requires_grad = old.requires_grad if isinstance(old, nn.Parameter) else False
    if isinstance(old, nn.Parameter):
        setattr(owner, leaf, nn.Parameter(value, requires_grad=requires_grad))
    else:
        owner.register_buffer(leaf, value)


def node_where(node: fx.Node) -> str:
    """'node N (module M)' for error messages."""
    info = get_meta(node, MODULE)
    return f"node {node.name} (module {info.path or '<root>'})" if info else f"node {node.name}"


def _check_divisible(region: TpRegion, tp_size: int) -> None:
    for node, p in list(region.placements.items()) + list(region.local_slices.items()):
        why = fits(node, p, tp_size)
        if why is not None:
            raise ShardingError(
                why,
                where=node_where(node),
                fix="choose a tp degree that divides the attention heads, kv heads and hidden sizes "
                    "(mesh dim 'tp'), or set tp=1")


def localize_sizes(node: fx.Node, p: Placement, tp_size: int) -> None:
    """Rewrite sizes baked into view/expand/split args to this rank's shard."""
    name = op_name(node)
    if name in ("view", "reshape", "_unsafe_view", "expand", "broadcast_to", *ALLOCATIONS):
        sizes = list(node.args[1])
        symbolic = sizes[p.dim] if isinstance(sizes[p.dim], fx.Node) else None
        if symbolic is not None:  # a symbolic size (a sequence of any length): divided at run time
            sizes[p.dim] = -1
        sizes = list(p.layout.local_shape(sizes, tp_size))
        if symbolic is not None:
            with node.graph.inserting_before(node):
                sizes[p.dim] = node.graph.call_function(operator.floordiv, (symbolic, p.parts or tp_size))
        node.args = (node.args[0], sizes, *node.args[2:])


def _rewrite_slice(node: fx.Node, src_p: Placement, tp_size: int) -> None:
    """A slice along whole blocks of a fused projection: its bounds in this rank's blocks."""
    dim, start, stop = slice_bounds(node)
    if not src_p.blocks or dim != src_p.dim:
        return
    offset = local = 0
    bounds = {}
    for block in src_p.layout.blocks_of(shape_of(node.args[0])[dim], tp_size):
        bounds.setdefault(offset, local)
        offset += block.extent
        local += block.local
        bounds[offset] = local
    node.args = (node.args[0], dim, bounds[start], bounds[stop], *node.args[4:])


def _rewrite_split(node: fx.Node, src_p: Placement, tp_size: int) -> None:
    if op_name(node) == "chunk":
        return  # a chunk count stays the same on the shard
    dim = node.args[2] if len(node.args) > 2 else 0
    if dim % len(shape_of(node.args[0])) != src_p.dim:
        return
    arg = node.args[1]
    if src_p.blocks:  # unequal blocks: each piece's local size
        node.args = (node.args[0], local_split_sizes(src_p, arg, tp_size=tp_size), *node.args[2:])
        return
    piece = replace(src_p.layout, chunks=1, inner=None)  # each piece: one block of the dim, or the whole dim
    new = [piece.local_size(a, tp_size) for a in arg] if isinstance(arg, (list, tuple)) \
        else piece.local_size(arg, tp_size)
    node.args = (node.args[0], new, *node.args[2:])


def _insert_copies(gm: fx.GraphModule, region: TpRegion, tp_size: int, counter: list) -> None:
    """An f before every replicated value the region reads that carries a gradient.

    The columns' input gets a :class:`TpCopy` (Megatron's f); any other such value (a q/k norm's
    weight, read on head shards) a :class:`TpGradSum`: both are the identity forward and sum the
    rank-partial gradient over tp backward.
    """
    inputs = {column_input(col): TpCopy for col in region.columns}
    for node in sorted(region.replicated_inputs, key=_order(gm)):
        inputs.setdefault(node, TpGradSum)
    for src, kind in inputs.items():
        users = [u for u in src.users if u in region.placements]
        if not users:
            continue
        name = f"tp_copy_{counter[0]}" if kind is TpCopy else f"tp_grad_sum_{counter[0]}"
        counter[0] += 1
        gm.add_submodule(name, kind(axis="tp", size=tp_size))
        first = min(users, key=_order(gm))
        with gm.graph.inserting_before(first):
            copy = gm.graph.call_module(name, (src,))
        copy.meta.update({k: v for k, v in first.meta.items() if k in ("nn_module_stack", MODULE)})
        if TENSOR in src.meta:
            copy.meta[TENSOR] = src.meta[TENSOR]
        for user in users:
            user.replace_input_with(src, copy)


def _insert_refinements(gm: fx.GraphModule, region: TpRegion, tp_rank: int, tp_size: int) -> None:
    """Before a view that merges a dim cut ``parts`` ways with the next, each rank narrows the next dim
    to its piece (its query heads among its kv group's); backward pads the rest with zeros."""
    for node, p in list(region.placements.items()):
        src = node.args[0] if node.op == "call_function" and node.args else None
        have = region.placements.get(src) if isinstance(src, fx.Node) else None
        if have is None or have.kind != "S" or not refines(src, node, have):
            continue
        ways = tp_size // have.parts
        with gm.graph.inserting_before(node):
            cut = gm.graph.call_function(local_shard, (src,), cut_kwargs(ShardLayout(have.dim + 1),
                                                                         rank=tp_rank % ways, size=ways))
        cut.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", MODULE)})
        node.replace_input_with(src, cut)


def insert_local_slices(gm: fx.GraphModule, slices: dict, inside, *, tp_rank: int, tp_size: int) -> None:
    """Each rank cuts its own shard of a value without a gradient (``slices``: {value: placement}) that the
    nodes ``inside`` (a region's, the vocabulary head's chain) read sharded."""
    for src, p in slices.items():
        users = [u for u in src.users if u in inside]
        first = min(users, key=_order(gm))
        with gm.graph.inserting_before(first):
            cut = gm.graph.call_function(local_shard, (src,), cut_kwargs(p.layout, rank=tp_rank, size=tp_size))
        cut.meta.update({k: v for k, v in first.meta.items() if k in ("nn_module_stack", MODULE)})
        set_meta(cut, TP_PLACEMENT, p)
        for user in users:
            user.replace_input_with(src, cut)


def _order(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]


def _partial_product(gm: fx.GraphModule, row: fx.Node) -> fx.Node:
    """The row's product without its bias (a partial sum on every rank)."""
    proj = projection_of(row)
    name = op_name(row)
    weight = proj.via if proj.via is not None else proj.weight
    if name == "linear":
        return gm.graph.call_function(aten.linear.default, (proj.x, weight))
    if name == "addmm":
        return gm.graph.call_function(aten.mm.default, (proj.x, weight))
    return gm.graph.call_function(row.target, tuple(row.args), dict(row.kwargs))


def _rewrite_row(gm: fx.GraphModule, row: fx.Node, tp_size: int, counter: list) -> None:
    bias = projection_of(row).bias
    name = f"tp_reduce_{counter[0]}"
    counter[0] += 1
    gm.add_submodule(name, TpReduce(axis="tp", size=tp_size))
    keep = {k: v for k, v in row.meta.items() if k in ("nn_module_stack", MODULE)}
    with gm.graph.inserting_after(row):
        partial = _partial_product(gm, row)
    with gm.graph.inserting_after(partial):
        reduced = gm.graph.call_module(name, (partial,))
    out = reduced
    if bias is not None:
        with gm.graph.inserting_after(reduced):
            out = gm.graph.call_function(aten.add.Tensor, (reduced, bias))
    for n in (partial, reduced, out):
        n.meta.update(keep)
    set_meta(partial, TP_PLACEMENT, Placement("P"))
    row.replace_all_uses_with(out)
    gm.graph.erase_node(row)


def cut_kwargs(layout: ShardLayout, *, rank: int, size: int) -> dict:
    """The keyword arguments of a :func:`~autopar.ops.tp_ops.local_shard` graph node cutting ``layout``."""
    return {"chunks": layout.chunks, **layout.fields(), "rank": rank, "size": size}


def _param_specs(region: TpRegion) -> dict[str, ShardLayout]:
    """Every parameter the region holds a shard of (weights, biases, per-head parameters).

    A parameter cut in one part (a single kv head every rank needs) is held whole: no spec.
    """
    return {node.target: p.layout for node, p in region.placements.items()
            if node.op == "get_attr" and p.kind == "S" and (p.parts != 1 or p.blocks)}


def _insert_group_sums(gm: fx.GraphModule, region: TpRegion, tp_rank: int, tp_size: int, counter: list) -> None:
    """A parameter piece held by several ranks (a replicated kv head) sums its gradient over them."""
    for node, p in list(region.placements.items()):
        if node.op != "get_attr" or p.kind != "S":
            continue
        extent = shape_of(node)[p.dim]
        blocks = p.layout.blocks_of(extent, tp_size) if p.blocks else (
            (extent, p.layout.local_size(extent, tp_size), p.layout.ways(tp_size)),)  # equal chunks: one piece
        if all(ways == tp_size for _, _, ways in blocks):
            continue
        name = f"tp_group_grad_sum_{counter[0]}"
        counter[0] += 1
        local = [(n, ways if ways != tp_size else 0) for _, n, ways in blocks]
        gm.add_submodule(name, TpGroupGradSum(axis="tp", size=tp_size, dim=p.dim, blocks=local, rank=tp_rank))
        first = min(node.users, key=_order(gm))  # where the weight is read: the sum sits in its module
        users = list(node.users)
        with gm.graph.inserting_before(first):
            summed = gm.graph.call_module(name, (node,))
        summed.meta.update({k: v for k, v in first.meta.items() if k in ("nn_module_stack", MODULE)})
        for user in users:
            user.replace_input_with(node, summed)


def _drop_assertions(gm: fx.GraphModule, region: TpRegion) -> None:
    """Export's metadata checks would compare a shard against the full shape: they are no-ops, drop them."""
    for node in list(region.placements):
        if node.op == "call_function" and op_name(node) in ASSERTIONS and not node.users:
            del region.placements[node]
            gm.graph.erase_node(node)


def shard_tensor_parallel(st: LoweringState) -> LoweringState:
    """Shard every region of ``st.regions`` over the Plan's tp ranks; ``specs`` gains {param: ShardLayout}."""
    gm, regions, tp_size, tp_rank = st.gm, st.regions, st.plan.mesh.tp, st.tp_rank
    specs: dict[str, ShardLayout] = {}
    counter = [0, 0]
    for region in regions:
        _check_divisible(region, tp_size)
        specs.update(_param_specs(region))
        for node, p in region.placements.items():
            set_meta(node, TP_PLACEMENT, p)
            if p.kind == "S":
                localize_sizes(node, p, tp_size)
                if op_name(node) == "slice":
                    _rewrite_slice(node, region.placements.get(node.args[0], REPLICATE), tp_size)
                if op_name(node) in ("split", "split_with_sizes"):
                    _rewrite_split(node, region.placements.get(node.args[0], REPLICATE), tp_size)
        copies, reduces = [counter[0]], [counter[1]]
        _drop_assertions(gm, region)
        insert_local_slices(gm, region.local_slices, region.placements, tp_rank=tp_rank, tp_size=tp_size)
        _insert_refinements(gm, region, tp_rank, tp_size)
        _insert_copies(gm, region, tp_size, copies)
        _insert_group_sums(gm, region, tp_rank, tp_size, copies)
        insert_partial_sums(gm, region, tp_size)  # reductions over the shard (passes/tp/tp_reduce_rules.py)
        for row in region.rows:
            _rewrite_row(gm, row, tp_size, reduces)
        insert_output_gathers(gm, region.gathers, tp_size=tp_size)
        counter = [copies[0], reduces[0]]
    for target, spec in specs.items():
        full = gm.get_parameter(target) if "." in target or hasattr(gm, target) else None
        set_param(gm, target, spec.cut(full.detach(), rank=tp_rank, size=tp_size))
    gm.graph.lint()
    gm.recompile()
    log.info("tensor parallel: %d regions, %d sharded parameters", len(regions), len(specs))
    return dataclasses.replace(st, gm=gm, specs={**st.specs, **specs})
