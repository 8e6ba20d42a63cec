"""Tensor-parallel placement rules, one per op family, as data.

A rule answers: given the placements of the inputs that are already sharded, what is the
output's placement and which other tensor inputs must be sharded (or may stay replicated)?
It raises :class:`NoRule` when the op cannot run on shards without communication; the solver
then leaves the whole region replicated. ``RULES`` maps an ATen op name to its rule.

Placements are :class:`autopar.ir.meta_keys.Placement`: R, S(dim[, chunks]) or P.
"""
from __future__ import annotations

import math
import operator
from types import MappingProxyType
from typing import Callable

import torch
import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, Placement, get_meta
from autopar.ops.context_parallel.ring import RingAttention
from autopar.ops.context_parallel.ulysses import UlyssesAttention
from autopar.passes.tp.tp_errors import NoRule
from autopar.passes.moe.tp_expert_rules import EXPERT_RULES
from autopar.passes.tp.tp_fused_blocks import blocks_between, split_blocks, split_piece, whole_broadcast
from autopar.passes.tp.tp_inplace_rules import INPLACE_RULES
from autopar.passes.tp.tp_reduce_rules import partial_sum_rule, read_replicated

__all__ = ["NoRule", "RULES", "ASSERTIONS", "ELEMENTWISE", "REPLICATE", "constant_value", "refines",
           "rule_for", "shape_of", "slice_bounds", "view_dim_map"]

REPLICATE = Placement("R")


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


def _S(p: Placement, dim: int, chunks: int | None = None) -> Placement:
    """``p`` moved to ``dim`` (its ways over tp kept; ``chunks`` changed when given)."""
    return p.replace(dim=dim, chunks=p.chunks if chunks is None else chunks, inner=None)


def _broadcast(node: fx.Node, placed: dict, out_dim: int, like: Placement, inputs: list[fx.Node]):
    """Out placement ``like`` on out_dim and what each input must be under right-aligned broadcasting."""
    out_rank = len(shape_of(node))
    need = {}
    for a in inputs:
        shape = shape_of(a)
        aligned = out_dim - (out_rank - len(shape))
        want = REPLICATE if aligned < 0 or shape[aligned] == 1 else _S(like, aligned)
        have = placed.get(a)
        if have is not None and like.parts == 1 and have == _S(like, aligned):
            want = have  # a single kv head every rank holds whole: its size-1 heads dim is no broadcast
        if have is not None and have != want and not read_replicated(a, have, want):  # a reduction, all-reduced
            raise NoRule(f"{node.name}: input {a.name} is {have}, needs {want}")
        need[a] = want
    return _S(like, out_dim), need


def elementwise(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    if p.kind != "S":
        raise NoRule(f"{node.name}: input {src.name} is {p}")
    out_dim = p.dim + (len(shape_of(node)) - len(shape_of(src)))
    return _broadcast(node, placed, out_dim, p, _tensor_args(node))


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
    if p.inner is not None:
        return _merge_inner(node, src, p), {src: p}
    if refines(src, node, p):
        return p.replace(parts=0), {src: p}
    in_shape, out_shape = shape_of(src), shape_of(node)
    if p.parts == 1 and in_shape[p.dim] == 1:  # one kv head every rank holds whole: follow its size-1 dim
        lead = math.prod(in_shape[:p.dim])
        for o, size in enumerate(out_shape):
            if size == 1 and math.prod(out_shape[:o]) == lead:
                return _S(p, o), {src: p}
        raise NoRule(f"{node.name} drops the heads dim of a single kv head")
    out_dim, chunks = view_dim_map(in_shape, out_shape, p.dim, p.chunks)
    if p.blocks:
        if in_shape[p.dim] % out_shape[out_dim] or math.prod(in_shape[:p.dim]) != math.prod(out_shape[:out_dim]):
            raise NoRule(f"{node.name} merges the blocks of a fused projection")
        return p.replace(dim=out_dim, blocks=_split_blocks(p, in_shape[p.dim] // out_shape[out_dim])), {src: p}
    while p.parts == 1 and out_dim > 0 and out_shape[out_dim - 1] == 1 and \
            math.prod(in_shape[:p.dim]) == math.prod(out_shape[:out_dim - 1]):
        out_dim -= 1  # one kv head every rank holds whole: the heads dim of size 1 carries it
    return _S(p, out_dim, chunks), {src: p}


def refines(src: fx.Node, node: fx.Node, p: Placement) -> bool:
    """Whether view ``node`` merges a dim cut ``parts`` ways with the next one (Falcon's q heads per kv
    group; one group, ``parts`` 1, with every rank in it): each rank of a group then narrows the next dim
    to its own piece (the transform inserts the cut), and the merged dim is cut tp ways."""
    if not p.parts or p.inner is not None or p.chunks != 1 or p.blocks:
        return False
    in_shape, out_shape, d = shape_of(src), shape_of(node), p.dim
    if p.parts == 1 and in_shape[d] != 1:  # whole on every rank: only a single group narrows the next dim
        return False
    return (d + 1 < len(in_shape) and in_shape[d + 1] > 1 and tuple(out_shape[:d]) == tuple(in_shape[:d])
            and len(out_shape) > d and out_shape[d] == in_shape[d] * in_shape[d + 1]
            and tuple(out_shape[d + 1:]) == tuple(in_shape[d + 2:]))


def _merge_inner(node: fx.Node, src: fx.Node, p: Placement) -> Placement:
    """(kv heads cut ``parts`` ways, query heads per kv head cut the rest) merged into one heads dim."""
    in_shape, out_shape = shape_of(src), shape_of(node)
    if p.inner != p.dim + 1 or p.chunks != 1:
        raise NoRule(f"{node.name}: a kv-head broadcast must be merged with the dim after it")
    lead = in_shape[:p.dim]
    merged = in_shape[p.dim] * in_shape[p.inner]
    if tuple(out_shape[:p.dim]) != tuple(lead) or len(out_shape) <= p.dim or out_shape[p.dim] != merged \
            or tuple(out_shape[p.dim + 1:]) != tuple(in_shape[p.inner + 1:]):
        raise NoRule(f"{node.name} does not merge the kv heads with their query heads")
    return p.replace(dim=p.dim, parts=0, inner=None)


def expand(node: fx.Node, placed: dict):
    """Broadcast; a kv head cut ``parts`` ways broadcast on the next dim cuts that dim the rest of the ways."""
    src, p = _anchor(node, placed)
    if (whole := whole_broadcast(shape_of(src), shape_of(node), p)) is not None:
        return whole, {src: p}  # one kv head every rank holds, broadcast to its query heads
    offset = len(shape_of(node)) - len(shape_of(src))
    out_dim = p.dim + offset
    if shape_of(node)[out_dim] != shape_of(src)[p.dim]:
        raise NoRule(f"{node.name} broadcasts the sharded dim")
    nxt = p.dim + 1
    if p.parts and p.inner is None and nxt < len(shape_of(src)) and shape_of(src)[nxt] == 1 \
            and shape_of(node)[nxt + offset] > 1:
        if shape_of(src)[p.dim] != p.parts:  # a rank holding several kv heads would take every group's piece
            raise NoRule(f"{node.name} broadcasts {shape_of(src)[p.dim]} kv heads cut {p.parts} ways to their "
                         f"query heads: a rank's query heads would not be contiguous")
        return _S(p, out_dim).replace(inner=nxt + offset), {src: p}
    return _S(p, out_dim), {src: p}


def index(node: fx.Node, placed: dict):
    """``x[..., idx]`` with one 1-D index tensor on a dim that is not sharded."""
    src, p = _anchor(node, placed)
    if node.args[0] is not src:
        raise NoRule(f"{node.name} indexes with a sharded index")
    indices = list(node.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if len(used) != 1 or not isinstance(indices[used[0]], fx.Node) or len(shape_of(indices[used[0]])) != 1:
        raise NoRule(f"{node.name}: only one 1-D index tensor is followed")
    if used[0] == p.dim:
        return _index_block(node, p, constant_value(indices[used[0]])), {src: p}
    return _S(p, p.dim), {src: p}


def constant_value(node: fx.Node):
    """The value of a constant index tensor (export lifts it: ``lift_fresh_copy(get_attr)``), or None."""
    if node.op == "call_function" and op_name(node) in ("lift_fresh_copy", "clone", "detach") and node.args:
        node = node.args[0]
    if node.op != "get_attr" or node.graph.owning_module is None:
        return None
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None


def _index_block(node: fx.Node, p: Placement, value) -> Placement:
    """``x[..., [i]]`` picking one head of a whole block every rank holds (multi-query's k and v in a fused
    ``[q | k | v]``), by a negative index that every rank's blocks resolve alike."""
    if not p.blocks or value is None or value.numel() != 1 or int(value) >= 0:
        raise NoRule(f"{node.name} indexes the sharded dim")
    at = sum(size for size, _ in p.blocks) + int(value)
    offset = 0
    for i, (size, parts) in enumerate(p.blocks):
        if offset <= at < offset + size:
            if parts != 1 or any(w != 1 for _, w in p.blocks[i:]):
                raise NoRule(f"{node.name} indexes a block cut over the ranks")
            return p.replace(blocks=(), parts=1, chunks=1)
        offset += size
    raise NoRule(f"{node.name} indexes outside the blocks")


def unsqueeze(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    d = _norm(node.args[1], len(shape_of(node)))
    return _S(p, p.dim + (1 if p.dim >= d else 0)), {src: p}


def transpose(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    rank = len(shape_of(src))
    d0, d1 = _norm(node.args[1], rank), _norm(node.args[2], rank)
    new = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    return _S(p, new), {src: p}


def permute(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    dims = [_norm(d, len(shape_of(src))) for d in node.args[1]]
    return _S(p, dims.index(p.dim)), {src: p}


def reverse_dims(node: fx.Node, placed: dict):
    """``x.T`` (``numpy_T``): every dim reversed; ``t`` (dims 0 and 1 of a 2-D x, a 1-D x as it is) alike."""
    src, p = _anchor(node, placed)
    return _S(p, len(shape_of(src)) - 1 - p.dim), {src: p}


def complex_view(node: fx.Node, placed: dict):
    """``view_as_complex`` (``(..., n, 2)`` -> ``(..., n)``) and ``view_as_real`` (the reverse): every dim
    but the pair keeps its place, so a shard of one of them stays where it is."""
    src, p = _anchor(node, placed)
    if op_name(node) == "view_as_complex" and p.dim == len(shape_of(src)) - 1:
        raise NoRule(f"{node.name} pairs the sharded dim into complex numbers")
    return p, {src: p}


def split(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    rank = len(shape_of(src))
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), rank)
    if dim != p.dim:
        return _S(p, p.dim), {src: p}
    size = shape_of(src)[dim]
    if op_name(node) == "chunk":
        sizes = [math.ceil(size / node.args[1])] * node.args[1]
    elif isinstance(node.args[1], (list, tuple)):
        sizes = list(node.args[1])
    else:
        sizes = [min(node.args[1], size - start) for start in range(0, size, node.args[1])]  # the last may be short
    if p.blocks:  # unequal blocks of a fused projection: each piece holds the blocks it covers
        return split_blocks(p, node.args[1], where=node.name), {src: p}
    if len(sizes) != p.chunks or len(set(sizes)) != 1:
        raise NoRule(f"{node.name} splits the sharded dim into {len(sizes)} parts, shard has {p.chunks}")
    return _S(p, p.dim, 1), {src: p}


def getitem(node: fx.Node, placed: dict):
    src = node.args[0]
    if src not in placed:
        raise NoRule(f"{node.name} indexes an unsharded value")
    piece = split_piece(src, placed[src], node.args[1])
    return piece or placed[src], {src: placed[src]}


def sdpa(node: fx.Node, placed: dict):
    q, k, v = node.args[:3]
    q_placed = placed.get(q)
    heads = q_placed if q_placed is not None and q_placed.kind == "S" else Placement.shard(1, 1)
    need = {}
    for a in (q, k, v):
        if a is not q and a in placed and placed[a].parts == 1 and shape_of(a)[1] == 1 and not heads.parts:
            need[a] = placed[a]  # one kv head every rank holds whole, broadcast over the query heads
            continue
        if a in placed and placed[a] != heads:
            raise NoRule(f"{node.name}: {a.name} is {placed[a]}, attention needs heads sharded")
        need[a] = heads
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        _, mask_need = _broadcast(node, placed, 1, heads, [mask])
        need.update(mask_need)
    return heads, need


def matmul(node: fx.Node, placed: dict):
    a, b = node.args[:2]
    src, p = _anchor(node, placed)
    if p.dim >= len(shape_of(src)) - 2:
        raise NoRule(f"{node.name} contracts or keeps a sharded matrix dim")
    out_dim = p.dim + len(shape_of(node)) - len(shape_of(src))
    _, need = _broadcast_batch(node, placed, out_dim, p, [a, b])
    return _S(p, out_dim), need


def _broadcast_batch(node, placed, out_dim, like, inputs):
    out_rank = len(shape_of(node))
    need = {}
    for x in inputs:
        shape = shape_of(x)
        aligned = out_dim - (out_rank - len(shape))
        want = REPLICATE if aligned < 0 or shape[aligned] == 1 else _S(like, aligned)
        if x in placed and placed[x] != want:
            raise NoRule(f"{node.name}: {x.name} is {placed[x]}, needs {want}")
        need[x] = want
    return None, need


def baddbmm(node: fx.Node, placed: dict):
    """``input + b1 @ b2`` (ALiBi attention): the shard must be a batch dim of the product."""
    inp, b1, b2 = node.args[:3]
    src, p = _anchor(node, placed)
    if src is not inp and p.dim != 0:
        raise NoRule(f"{node.name} contracts or keeps a sharded matrix dim")
    if src is inp and p.dim != 0:
        raise NoRule(f"{node.name}: its added input is sharded on a matrix dim")
    _, need = _broadcast_batch(node, placed, 0, p, [b1, b2])
    _, extra = _broadcast(node, placed, 0, p, [inp])
    return _S(p, 0), {**need, **extra}


def stack(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    d = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape_of(node)))
    need = {}
    for t in node.args[0]:
        if t in placed and placed[t] != p:
            raise NoRule(f"{node.name}: {t.name} is {placed[t]}, needs {p}")
        need[t] = p
    return _S(p, p.dim + (1 if p.dim >= d else 0)), need


def assertion(node: fx.Node, placed: dict):
    """Export's no-op checks (``_assert_tensor_metadata``): no output; the transform drops them."""
    src, _ = _anchor(node, placed)
    return REPLICATE, {src: placed[src]}


ASSERTIONS = ("_assert_tensor_metadata", "_assert_async", "_functional_assert_async", "_assert_scalar",
              "_functional_assert_scalar")


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
    return _S(p, new), {src: p}


def slice_bounds(node: fx.Node) -> tuple[int, int, int]:
    """(dim, start, stop) of ``aten.slice`` with python-style bounds resolved."""
    size_in = shape_of(node.args[0])
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, len(size_in))
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    stop = node.args[3] if len(node.args) > 3 and node.args[3] is not None else size_in[dim]
    n = size_in[dim]
    start, stop = (start + n if start < 0 else start), (stop + n if stop < 0 else stop)
    return dim, max(0, min(start, n)), max(0, min(stop, n))


def slice_(node: fx.Node, placed: dict):
    """A slice of another dim; of the sharded dim only along whole blocks of a fused projection."""
    src, p = _anchor(node, placed)
    dim, start, stop = slice_bounds(node)
    if dim != p.dim:
        return p, {src: p}
    if not p.blocks or (len(node.args) > 4 and node.args[4] != 1):
        raise NoRule(f"{node.name} slices the sharded dim")
    return blocks_between(p, start, stop, where=node.name), {src: p}


def _split_blocks(p: Placement, factor: int) -> tuple[tuple[int, int], ...]:
    if any(size % factor for size, _ in p.blocks):
        raise NoRule("a view cuts inside a block of a fused projection")
    return tuple((size // factor, parts) for size, parts in p.blocks)


def select(node: fx.Node, placed: dict):
    src, p = _anchor(node, placed)
    dim = _norm(node.args[1], len(shape_of(src)))
    if dim == p.dim:
        raise NoRule(f"{node.name} selects along the sharded dim")
    return _S(p, p.dim - (1 if dim < p.dim else 0)), {src: p}


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

ELEMENTWISE = _ELEMENTWISE_NAMES

RULES: "MappingProxyType[str, Callable]" = MappingProxyType({
    **{name: elementwise for name in _ELEMENTWISE_NAMES},
    "view": view, "reshape": view, "_unsafe_view": view, "flatten": view, "unflatten": view,
    "expand": expand, "broadcast_to": expand, "unsqueeze": unsqueeze, "transpose": transpose, "t": reverse_dims,
    "permute": permute, "numpy_T": reverse_dims, "split": split, "split_with_sizes": split, "chunk": split,
    "getitem": getitem, "scaled_dot_product_attention": sdpa, "matmul": matmul, "bmm": matmul,
    "softmax": softmax, "_softmax": softmax, "log_softmax": softmax, "_log_softmax": softmax,
    "mean": partial_sum_rule(reduce_dims), "sum": partial_sum_rule(reduce_dims),  # passes/tp/tp_reduce_rules.py
    "amax": reduce_dims, "slice": slice_,
    "select": select, "cat": cat, "index": index, "baddbmm": baddbmm, "stack": stack,
    **{name: assertion for name in ASSERTIONS},
    **EXPERT_RULES,  # grouped expert products (passes/moe/tp_expert_rules.py)
    **INPLACE_RULES, "copy_": elementwise,  # allocations filled in place (passes/tp/tp_inplace_rules.py)
    "view_as_complex": complex_view, "view_as_real": complex_view,
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


def _head_wise(node: fx.Node) -> bool:
    """A graph op computing attention head by head on ``[B, H, L, D]`` (context parallelism's ring and
    all-to-all attention): it shards over tp on its heads as SDPA does."""
    owner = node.graph.owning_module
    module = owner.get_submodule(node.target) if owner is not None and node.op == "call_module" else None
    return isinstance(module, (RingAttention, UlyssesAttention))


def rule_for(node: fx.Node) -> Callable:
    """The placement rule of ``node``'s op, or raise NoRule naming the op."""
    if node.op == "call_module" and _head_wise(node):
        return sdpa
    if node.op != "call_function":
        raise NoRule(f"{node.name} is a {node.op} node")
    rule = RULES.get(op_name(node))
    if rule is None:
        raise NoRule(f"no tensor-parallel rule for op {op_name(node)} (node {node.name})")
    return rule
