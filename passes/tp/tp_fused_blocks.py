"""Unequal blocks of a fused projection read by a split, and a single kv head broadcast to its query heads.

GPT-BigCode's multi-query ``c_attn`` is ``[q (H) | k (head_dim) | v (head_dim)]``, read by
``split_with_sizes((H, hd, hd), dim=-1)`` after an ``unsqueeze`` that makes the heads dim (of size 1
for k and v) and the k and v broadcast to the query heads with ``unsqueeze`` + ``expand`` + ``reshape``
(transformers' ``repeat_kv``). Placements here (:class:`autopar.ir.meta_keys.Placement`):

- a split along a dim holding unequal ``blocks`` keeps them; each piece (``getitem``) holds the
  blocks it covers whole (:func:`split_piece`), a single block as a plain shard with its ``parts``;
- a value every rank holds whole (``parts=1``) broadcast on one dim after a size-1 dim is one kv head
  broadcast to its query heads: the size-1 dim is its heads dim, the broadcast one is cut over tp
  (``inner``, as a GQA kv head's; :func:`whole_broadcast`);
- the kv heads of a block read that way are the dim before the broadcast one (:func:`broadcast_heads`).

The rules of :mod:`autopar.passes.tp.tp_rules` and the seeds of :mod:`autopar.passes.tp.tp_regions` call these;
nothing here knows a model. Example::

    >>> from autopar.ir.meta_keys import Placement
    >>> p = Placement.shard(3, blocks=((32, 0), (8, 1), (8, 1)))
    >>> local_split_sizes(p, [32, 8, 8], tp_size=4)  # the q heads cut 4 ways, k and v whole
    [8, 8, 8]
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, Placement, get_meta
from autopar.passes.tp.tp_errors import NoRule

__all__ = ["SPLITS", "blocks_between", "broadcast_heads", "local_split_sizes", "split_blocks", "split_piece",
           "split_pieces", "whole_broadcast"]

SPLITS = ("split", "split_with_sizes", "chunk")


def _op(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", "")


def _shape(node) -> tuple[int, ...] | None:
    info = get_meta(node, TENSOR) if isinstance(node, fx.Node) else None
    return None if info is None else info.shape


def blocks_between(p: Placement, start: int, stop: int, *, where: str) -> Placement:
    """The placement of ``[start, stop)`` of a dim holding ``p.blocks``: the whole blocks inside it,
    a single block as a plain shard cut ``parts`` ways (:meth:`ShardLayout.between`)."""
    try:
        return Placement("S", p.layout.between(start, stop))
    except ValueError:
        raise NoRule(f"{where} cuts across the blocks of a fused projection") from None


def _bounds(sizes) -> list[tuple[int, int]]:
    out, offset = [], 0
    for size in sizes:
        out.append((offset, offset + size))
        offset += size
    return out


def split_blocks(p: Placement, sizes, *, where: str) -> Placement:
    """A split of the dim holding ``p.blocks`` into listed ``sizes``: each piece must cover whole blocks
    (a split into equal pieces or chunks would not stay equal on a rank's blocks)."""
    if not isinstance(sizes, (list, tuple)):
        raise NoRule(f"{where} splits the unequal blocks of a fused projection into equal pieces")
    for start, stop in _bounds(sizes):
        blocks_between(p, start, stop, where=where)
    return p


def _split_sizes(split: fx.Node) -> list[int] | None:
    shape = _shape(split.args[0])
    if shape is None:
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    size = shape[dim % len(shape)]
    arg = split.args[1]
    if _op(split) == "chunk":
        return [-(-size // arg)] * arg
    return list(arg) if isinstance(arg, (list, tuple)) else [arg] * -(-size // arg)


def split_piece(split: fx.Node, p: Placement, index: int) -> Placement | None:
    """The placement of piece ``index`` of ``split`` (its input placed ``p``), or None when the split
    does not cut the dim holding ``p.blocks``."""
    if not p.blocks or _op(split) not in SPLITS:
        return None
    rank = len(_shape(split.args[0]))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim % rank != p.dim:
        return None
    start, stop = _bounds(_split_sizes(split))[index]
    return blocks_between(p, start, stop, where=split.name)


def local_split_sizes(p: Placement, sizes, *, tp_size: int) -> list[int]:
    """The sizes one rank splits its shard of a dim holding ``p.blocks`` into."""
    return [blocks_between(p, start, stop, where="split").layout.local_size(stop - start, tp_size)
            for start, stop in _bounds(sizes)]


def split_pieces(node: fx.Node, dim: int) -> list[tuple[int, int, fx.Node]]:
    """(start, stop, getitem) of each piece of a split of ``node`` into unequal sizes along ``dim``.

    Equal splits are left to the chunks of a fused projection (``seed_chunks``)."""
    shape = _shape(node)
    out = []
    for user in node.users:
        if _op(user) not in ("split", "split_with_sizes") or user.args[0] is not node or shape is None:
            continue
        d = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
        sizes = _split_sizes(user)
        readers = {u.args[1]: u for u in user.users if u.target is operator.getitem}
        if d % len(shape) != dim or len(set(sizes)) < 2 or sorted(readers) != list(range(len(sizes))) \
                or len(readers) != len(user.users):
            continue
        out += [(start, stop, readers[i]) for i, (start, stop) in enumerate(_bounds(sizes))]
    return out


def _broadcast_dim(in_shape, out_shape) -> int | None:
    """The one dim (of ``out_shape``) an ``expand`` broadcasts from size 1, or None."""
    offset = len(out_shape) - len(in_shape)
    dims = [d for d in range(offset, len(out_shape)) if in_shape[d - offset] == 1 and out_shape[d] > 1]
    return dims[0] if len(dims) == 1 and all(out_shape[d] == in_shape[d - offset] for d in range(offset, len(
        out_shape)) if d != dims[0]) else None


def broadcast_heads(node: fx.Node, depth: int = 0) -> int | None:
    """The kv heads of ``node`` when it is broadcast to its query heads (``unsqueeze`` then ``expand`` of
    the new dim, transformers' ``repeat_kv``): the size of the dim before the broadcast one."""
    for user in node.users:
        if _op(user) == "unsqueeze" and depth < 3:
            found = broadcast_heads(user, depth + 1)
            if found is not None:
                return found
        elif _op(user) in ("expand", "broadcast_to") and depth > 0:
            in_shape, out_shape = _shape(node), _shape(user)
            b = _broadcast_dim(in_shape, out_shape) if in_shape and out_shape else None
            if b is not None and b > 0 and len(in_shape) == len(out_shape):
                return in_shape[b - 1]
    return None


def whole_broadcast(in_shape, out_shape, p: Placement) -> Placement | None:
    """A value every rank holds whole (``parts=1``) broadcast on one dim after a size-1 dim: one kv head
    broadcast to its query heads, placed on the size-1 dim with the broadcast dim cut over tp (``inner``)."""
    if p.parts != 1 or p.inner is not None or p.blocks or len(in_shape) != len(out_shape):
        return None
    b = _broadcast_dim(in_shape, out_shape)
    if b is None or b == 0 or in_shape[b - 1] != 1:
        return None
    return p.replace(dim=b - 1, chunks=1, inner=b)
