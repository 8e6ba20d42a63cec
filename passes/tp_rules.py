"""Tensor-parallel placement rules, one per op family, as data.

A rule answers: given the placements of the inputs that are already sharded, what is the
output's placement and which other tensor inputs must be sharded (or may stay replicated)?
It raises :class:`NoRule` when the op cannot run on shards without communication; the solver
then leaves the whole region replicated. ``RULES`` maps an ATen op name to its rule.

Placements are :class:`autopar.passes.meta_keys.Placement`: R, S(dim[, chunks]) or P.
"""
from __future__ import annotations

import math
import operator
from types import MappingProxyType
from typing import Callable

import torch
import torch.fx as fx

from autopar.passes.meta_keys import TENSOR, Placement, get_meta
from autopar.passes.tp_expert_rules import EXPERT_RULES

__all__ = ["NoRule", "RULES", "rule_for", "shape_of", "view_dim_map", "REPLICATE"]

REPLICATE = Placement("R")


class NoRule(Exception):
    """The op cannot run on sharded inputs without communication (reason in the message)."""


def shape_of(node) -> tuple[int, ...]:
    info = get_meta(node, TENSOR) if isinstance(node, fx.Node) else None
    if info is None or info.shape is None:
        raise NoRule(f"no shape recorded for {node}")
    return info.shape


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    flat = []
    for a in list(node.args) + list(node.kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        flat += [x for x in items if isinstance(x, fx.Node) and get_meta(x, TENSOR) is not None
                 and get_meta(x, TENSOR).shape is not None]
    return flat


def _anchor(node: fx.Node, placed: dict) -> tuple[fx.Node, Placement]:
    for a in _tensor_args(node):
        if a in placed:
            return a, placed[a]
    raise NoRule(f"{node.name} has no sharded input")


def _broadcast(node: fx.Node, placed: dict, out_dim: int, chunks: int, inputs: list[fx.Node]):
    """Out placement S(out_dim) and what each input must be under right-aligned broadcasting."""
    out_rank = len(shape_of(node))
    need = {}
    for a in inputs:
        shape = shape_of(a)
        aligned = out_dim - (out_rank - len(shape))
        want = REPLICATE if aligned < 0 or shape[aligned] == 1 else Placement("S", aligned, chunks)
        have = placed.get(a)
        if have is not None and have != want:
            raise NoRule(f"{node.name}: input {a.name} is {have}, needs {want}")
        need[a] = want
    return Placement("S", out_dim, chunks), need


def elementwise(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    if p.kind != "S":
        raise NoRule(f"{node.name}: input {src.name} is {p}")
    out_dim = p.dim + (len(shape_of(node)) - len(shape_of(src)))
    return _broadcast(node, placed, out_dim, p.chunks, _tensor_args(node))


def view_dim_map(in_shape, out_shape, dim: int, chunks: int) -> tuple[int, int]:
    """Where sharded ``dim`` (with ``chunks``) of ``in_shape`` lands in ``out_shape`` after a view."""
    i = o = 0
    while i < len(in_shape) or o < len(out_shape):
        i0, o0 = i, o
        pin = in_shape[i] if i < len(in_shape) else 1
        pout = out_shape[o] if o < len(out_shape) else 1
        i, o = i + 1, o + 1
        while pin != pout:
            if pin < pout:
                pin *= in_shape[i]
                i += 1
            else:
                pout *= out_shape[o]
                o += 1
        if i0 <= dim < i:
            return _map_group(in_shape[i0:i], out_shape[o0:o], dim - i0, chunks, o0)
    raise NoRule(f"dim {dim} not found in view {in_shape} -> {out_shape}")


def _map_group(in_group, out_group, local_dim, chunks, o0):
    """Map a sharded dim inside one group of a view (merge, split or 1:1)."""
    outer = math.prod(in_group[:local_dim]) * chunks  # blocks before each shard along the group
    if any(s != 1 for s in in_group[:local_dim]) and len(out_group) > 1:
        raise NoRule("sharded dim is not outermost in a many-to-many view")
    acc = 1
    for k, size in enumerate(out_group):
        if size == 1:
            continue
        if acc == outer or (outer % (acc * size) != 0 and outer % acc == 0):
            new_chunks = outer // acc
            if size % new_chunks != 0:
                raise NoRule("chunked shard does not fit the view")
            return o0 + k, new_chunks
        acc *= size
    raise NoRule("sharded dim vanishes in view")


def view(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    out_dim, chunks = view_dim_map(shape_of(src), shape_of(node), p.dim, p.chunks)
    return Placement("S", out_dim, chunks), {src: p}


def expand(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    out_dim = p.dim + len(shape_of(node)) - len(shape_of(src))
    if shape_of(node)[out_dim] != shape_of(src)[p.dim]:
        raise NoRule(f"{node.name} broadcasts the sharded dim")
    return Placement("S", out_dim, p.chunks), {src: p}


def unsqueeze(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    d = _norm(node.args[1], len(shape_of(node)))
    return Placement("S", p.dim + (1 if p.dim >= d else 0), p.chunks), {src: p}


def transpose(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    rank = len(shape_of(src))
    d0, d1 = _norm(node.args[1], rank), _norm(node.args[2], rank)
    new = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    return Placement("S", new, p.chunks), {src: p}


def permute(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    dims = [_norm(d, len(shape_of(src))) for d in node.args[1]]
    return Placement("S", dims.index(p.dim), p.chunks), {src: p}


def split(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    rank = len(shape_of(src))
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank)
    if dim != p.dim:
        return Placement("S", p.dim, p.chunks), {src: p}
    size = shape_of(src)[dim]
    if op_name(node) == "chunk":
        sizes = [math.ceil(size / node.args[1])] * node.args[1]
    elif isinstance(node.args[1], (list, tuple)):
        sizes = list(node.args[1])
    else:
        sizes = [node.args[1]] * math.ceil(size / node.args[1])
    if len(sizes) != p.chunks or len(set(sizes)) != 1:
        raise NoRule(f"{node.name} splits the sharded dim into {len(sizes)} parts, shard has {p.chunks}")
    return Placement("S", p.dim, 1), {src: p}


def getitem(node: fx.Node, placed: dict):
    src = node.args[0]
    if src not in placed:
        raise NoRule(f"{node.name} indexes an unsharded value")
    return placed[src], {src: placed[src]}


def sdpa(node: fx.Node, placed: dict):
    q, k, v = node.args[:3]
    heads = Placement("S", 1, 1)
    need = {}
    for a in (q, k, v):
        if a in placed and placed[a] != heads:
            raise NoRule(f"{node.name}: {a.name} is {placed[a]}, attention needs heads sharded")
        need[a] = heads
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        _, mask_need = _broadcast(node, placed, 1, 1, [mask])
        need.update(mask_need)
    return heads, need


def matmul(node: fx.Node, placed: dict):
    a, b = node.args[:2]
    src, p = _anchor(node, placed)
    if p.dim >= len(shape_of(src)) - 2:
        raise NoRule(f"{node.name} contracts or keeps a sharded matrix dim")
    out_dim = p.dim + len(shape_of(node)) - len(shape_of(src))
    _, need = _broadcast_batch(node, placed, out_dim, p.chunks, [a, b])
    return Placement("S", out_dim, p.chunks), need


def _broadcast_batch(node, placed, out_dim, chunks, inputs):
    out_rank = len(shape_of(node))
    need = {}
    for x in inputs:
        shape = shape_of(x)
        aligned = out_dim - (out_rank - len(shape))
        want = REPLICATE if aligned < 0 or shape[aligned] == 1 else Placement("S", aligned, chunks)
        if x in placed and placed[x] != want:
            raise NoRule(f"{node.name}: {x.name} is {placed[x]}, needs {want}")
        need[x] = want
    return None, need


def softmax(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    if _norm(node.args[1], len(shape_of(src))) == p.dim:
        raise NoRule(f"{node.name} normalises over the sharded dim")
    return p, {src: p}


def reduce_dims(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    rank = len(shape_of(src))
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        raise NoRule(f"{node.name} reduces every dim")
    dims = [_norm(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if p.dim in dims:
        raise NoRule(f"{node.name} reduces over the sharded dim")
    keep = len(shape_of(node)) == rank
    new = p.dim if keep else p.dim - sum(1 for d in dims if d < p.dim)
    return Placement("S", new, p.chunks), {src: p}


def slice_(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(shape_of(src)))
    if dim == p.dim:
        raise NoRule(f"{node.name} slices the sharded dim")
    return p, {src: p}


def select(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    dim = _norm(node.args[1], len(shape_of(src)))
    if dim == p.dim:
        raise NoRule(f"{node.name} selects along the sharded dim")
    return Placement("S", p.dim - (1 if dim < p.dim else 0), p.chunks), {src: p}


def cat(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    tensors = node.args[0]
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(shape_of(node)))
    if dim == p.dim:
        raise NoRule(f"{node.name} concatenates along the sharded dim")
    need = {}
    for t in tensors:
        if t in placed and placed[t] != p:
            raise NoRule(f"{node.name}: {t.name} is {placed[t]}, needs {p}")
        need[t] = p
    return p, need


_ELEMENTWISE_NAMES = (
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "exp", "pow",
    "rsqrt", "sqrt", "dropout", "clone", "contiguous", "to", "_to_copy", "type_as", "alias",
    "detach", "where", "masked_fill", "cos", "sin", "abs", "erf", "log", "square", "reciprocal",
    "rsub", "maximum", "minimum", "clamp", "leaky_relu", "hardtanh", "softplus", "mish",
)

RULES: "MappingProxyType[str, Callable]" = MappingProxyType({
    **{name: elementwise for name in _ELEMENTWISE_NAMES},
    "view": view, "reshape": view, "_unsafe_view": view, "flatten": view, "unflatten": view,
    "expand": expand, "unsqueeze": unsqueeze, "transpose": transpose, "t": transpose,
    "permute": permute, "split": split, "split_with_sizes": split, "chunk": split,
    "getitem": getitem, "scaled_dot_product_attention": sdpa, "matmul": matmul, "bmm": matmul,
    "softmax": softmax, "_softmax": softmax, "log_softmax": softmax, "_log_softmax": softmax,
    "mean": reduce_dims, "sum": reduce_dims, "amax": reduce_dims, "slice": slice_,
    "select": select, "cat": cat,
    **EXPERT_RULES,  # grouped expert products (passes/tp_expert_rules.py)
})


def op_name(node: fx.Node) -> str:
    """The ATen op family name of a call_function node ('getitem' for operator.getitem)."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def rule_for(node: fx.Node) -> Callable:
    """The placement rule of ``node``'s op, or raise NoRule naming the op."""
    if node.op != "call_function":
        raise NoRule(f"{node.name} is a {node.op} node")
    rule = RULES.get(op_name(node))
    if rule is None:
        raise NoRule(f"no tensor-parallel rule for op {op_name(node)} (node {node.name})")
    return rule
