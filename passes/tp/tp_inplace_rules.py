"""Tensor-parallel placement rules of a tensor allocated and then filled in place, as data.

Code that builds a tensor piece by piece (DeepSeek's multi-head latent attention builds its keys as
``k = x.new_empty(b, heads, s, nope + rope)``, then ``k[..., :nope].copy_(k_nope)`` and
``k[..., nope:].copy_(k_rope)``) shows up in a captured graph as an allocation (``new_empty``,
``new_zeros``, ``new_ones``, ``new_full``) whose sizes are literals, slices of it, and ``copy_`` into
those slices; later ops read the allocation. The rules:

- ``x.new_empty(sizes)`` with ``x`` placed ``S(d)`` and ``sizes`` of ``x``'s rank whose dim ``d`` is
  ``x``'s: the allocation is ``S(d)`` too (its size was read off ``x``, which each rank now holds a
  shard of; the transform writes the local size into ``sizes`` as it does for a view). Pulled back
  (a region needs it sharded), it needs nothing of ``x``, whose dtype and device alone it reads;
- ``dst.copy_(src)``: an elementwise op whose output is ``dst``: ``src`` the same shard, right-aligned,
  or replicated where it broadcasts over the sharded dim (a rotary key every head shares); registered
  with the elementwise rule in :data:`autopar.passes.tp.tp_rules.RULES`.

:data:`INPLACE_RULES` is registered in :data:`autopar.passes.tp.tp_rules.RULES`,
:data:`INPLACE_PULL_BACKS` in :data:`autopar.passes.tp.tp_pullback_rules.PULL_BACK_RULES`; nothing here knows
a model.
"""
from __future__ import annotations

from types import MappingProxyType

import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, Placement, get_meta
from autopar.passes.tp.tp_errors import NoRule

__all__ = ["ALLOCATIONS", "INPLACE_RULES", "INPLACE_PULL_BACKS", "allocation", "allocation_back", "sizes_of"]

ALLOCATIONS = ("new_empty", "new_zeros", "new_ones", "new_full")


def _shape(node) -> tuple[int, ...]:
    info = get_meta(node, TENSOR) if isinstance(node, fx.Node) else None
    if info is None or info.shape is None:
        raise NoRule(f"no shape recorded for {node}")
    return info.shape


def sizes_of(node: fx.Node) -> list:
    """The literal sizes an allocation node is called with (``new_full``'s come before its fill value)."""
    sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("size")
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes):
        raise NoRule(f"{node.name}: the sizes of the allocation are not literals")
    return list(sizes)


def _plain(node: fx.Node, p: Placement) -> None:
    if p.kind != "S" or p.blocks or p.inner is not None or p.chunks != 1:
        raise NoRule(f"{node.name}: only a plain shard is allocated ({p})")


def allocation(node: fx.Node, placed: dict):
    """``x.new_empty(sizes)`` from a sharded ``x``: sharded alike when ``sizes`` keep ``x``'s sharded dim."""
    src = node.args[0]
    p = placed.get(src)
    if p is None:
        raise NoRule(f"{node.name} has no sharded input")
    _plain(node, p)
    sizes, shape = sizes_of(node), _shape(src)
    if len(sizes) != len(shape) or sizes[p.dim] != shape[p.dim]:
        raise NoRule(f"{node.name} allocates {tuple(sizes)}, not {src.name}'s sharded dim {p.dim} of {tuple(shape)}")
    return p, {src: p}


def allocation_back(node: fx.Node, p: Placement) -> dict:
    """An allocation a region needs sharded: the local sizes are written in; its input (dtype, device) is not read."""
    _plain(node, p)
    if p.dim >= len(sizes_of(node)):
        raise NoRule(f"{node.name} has no dim {p.dim}")
    return {}


INPLACE_RULES: "MappingProxyType[str, object]" = MappingProxyType({name: allocation for name in ALLOCATIONS})
INPLACE_PULL_BACKS: "MappingProxyType[str, object]" = MappingProxyType({name: allocation_back for name in ALLOCATIONS})
