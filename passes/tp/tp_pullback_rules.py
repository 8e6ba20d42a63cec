"""Pull-back rules: which input placements give a node the shard a region needs of it.

The region solver (:mod:`autopar.passes.tp.tp_regions`) propagates shards forward from the column
linears; where an op needs an input sharded that is computed replicated outside the region (the
attention mask of ``scaled_dot_product_attention``, sharded on its heads), it pulls the shard back
to where the value comes from. Shape ops (view, permute, unsqueeze ...) it pulls back by trying
their forward rules; the ops here say directly what their inputs must be:

- elementwise ops (``where``, ``add``, ``to`` ...): each input the output's shard under broadcasting,
  replicated where it broadcasts over the sharded dim (T5's ``where(mask, position_bias, min)``);
- ``embedding(table, ids)`` sharded on its last dim: the table's column shard, the ids replicated
  (T5's ``relative_attention_bias``: a table of (buckets, heads) whose lookup is permuted to heads);
- ``table[idx]`` (``aten.index`` with one index tensor) sharded on a dim the index does not make:
  the table sharded on that dim (Swin's ``relative_position_bias_table`` of (entries, heads));
- ``slice`` and ``cat`` along another dim: their inputs sharded alike (a rotary half of each head's
  features, cut off and joined back, DeepSeek's interleaved rotary);
- an allocation filled in place (``new_empty``): nothing of its input (:mod:`autopar.passes.tp.tp_inplace_rules`).

:func:`broadcast_back` pulls a shard back through a broadcast (``expand``) of a size-1 dim: the input
whole, each rank broadcasting it to its own shard (one rotary key every head shares). The solver tries it
after the forward rule of ``expand`` found no input shard.

A table is a parameter: the solver holds its column shard (:meth:`_Solver._shard_param`), each rank
looks up its own heads' columns, and their gradient stays on the rank. :func:`pull_back_rule` gives the
rule of a node's op, or None.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import torch.fx as fx

from autopar.ir.meta_keys import Placement
from autopar.passes.tp.tp_errors import NoRule
from autopar.passes.tp.tp_inplace_rules import INPLACE_PULL_BACKS
from autopar.passes.tp.tp_rules import ELEMENTWISE, REPLICATE, _broadcast, _norm, _tensor_args, op_name, shape_of, \
    slice_bounds

__all__ = ["PULL_BACK_RULES", "pull_back_rule", "broadcast_back"]


def _check(node: fx.Node, p: Placement) -> None:
    if p.kind != "S" or p.blocks or p.inner is not None:
        raise NoRule(f"{node.name} ({op_name(node)}) would need to be {p}: only a plain shard is pulled back")


def elementwise_back(node: fx.Node, p: Placement) -> dict:
    """Each input the output's shard, right-aligned; replicated where it broadcasts over that dim."""
    _check(node, p)
    _, need = _broadcast(node, {}, p.dim, p, _tensor_args(node))
    return need


def embedding_back(node: fx.Node, p: Placement) -> dict:
    """``embedding(table, ids)`` sharded on its last dim: the table's columns, the ids whole."""
    _check(node, p)
    table, ids = node.args[:2]
    if p.dim != len(shape_of(node)) - 1:
        raise NoRule(f"{node.name} would be sharded on a dim of its ids, not on the table's columns")
    return {table: Placement.shard(1, p.chunks, p.parts), ids: REPLICATE}


def index_back(node: fx.Node, p: Placement) -> dict:
    """``table[..., idx, ...]`` with one index tensor: the table sharded on the dim the output's shard comes from."""
    _check(node, p)
    table, indices = node.args[0], list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if len(used) != 1 or not isinstance(indices[used[0]], fx.Node):
        raise NoRule(f"{node.name}: only an index with one index tensor is pulled back")
    at, idx = used[0], indices[used[0]]
    width = len(shape_of(idx))
    if at <= p.dim < at + width:
        raise NoRule(f"{node.name} would be sharded on a dim its index tensor makes")
    dim = p.dim if p.dim < at else p.dim - width + 1
    return {table: Placement.shard(dim, p.chunks, p.parts), idx: REPLICATE}


def slice_back(node: fx.Node, p: Placement) -> dict:
    """``x[..., a:b]`` along another dim than the shard's: ``x`` sharded alike."""
    _check(node, p)
    dim, _, _ = slice_bounds(node)
    if dim == p.dim:
        raise NoRule(f"{node.name} slices the dim it would be sharded on")
    return {node.args[0]: p}


def cat_back(node: fx.Node, p: Placement) -> dict:
    """``cat(tensors, dim)`` along another dim than the shard's: every piece sharded alike."""
    _check(node, p)
    dim = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape_of(node)))
    if dim == p.dim:
        raise NoRule(f"{node.name} concatenates along the dim it would be sharded on")
    return {t: p for t in node.args[0]}


def broadcast_back(node: fx.Node, p: Placement) -> dict:
    """``expand(x, sizes)`` sharded on a dim it broadcasts from size 1 (or makes): ``x`` whole, each rank
    expanding it to its own shard's size (the transform writes the local size into ``sizes``)."""
    _check(node, p)
    if op_name(node) not in ("expand", "broadcast_to"):
        raise NoRule(f"{node.name} is not a broadcast")
    src = node.args[0]
    aligned = p.dim - (len(shape_of(node)) - len(shape_of(src)))
    if aligned >= 0 and shape_of(src)[aligned] != 1:
        raise NoRule(f"{node.name} does not broadcast its dim {p.dim}")
    return {src: REPLICATE}


PULL_BACK_RULES: "MappingProxyType[str, Callable]" = MappingProxyType({
    **{name: elementwise_back for name in ELEMENTWISE},
    "embedding": embedding_back, "index": index_back, "slice": slice_back, "cat": cat_back,
    **INPLACE_PULL_BACKS,
})


def pull_back_rule(node: fx.Node) -> Callable | None:
    """The pull-back rule of ``node``'s op, or None (shape ops are pulled back through their forward rules)."""
    if node.op != "call_function":
        return None
    return PULL_BACK_RULES.get(op_name(node))
