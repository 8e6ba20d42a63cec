"""The sequence rules per ATen op family, as data: where the sequence goes, or why cp cannot shard it.

A rule takes the node and the :class:`Reader` of what is known so far and returns an :class:`Outcome`
(the output's :class:`~autopar.passes.context_parallel.seq_place.Place` or None, the rule's name, a note
saying what cp does there), or raises :class:`Refuse` with the reason and the fix. ``RULES`` maps an op
family (``softmax``, ``linear``, ...) to its rule. The rule names:

- ``pointwise``: the value follows the shard (linear layers, norms, elementwise ops, views that keep
  the sequence dim, embedding lookups of sharded ids);
- ``positional``: computed from positions alone (rotary tables, a learned position table's rows): under
  cp it is computed at the rank's global positions;
- ``label_shift``: a slice or pad that moves the sequence by k positions (``labels[..., 1:]``,
  ``logits[..., :-1, :]``, transformers' ``pad(labels, (0, 1))[..., 1:]``): across chunk boundaries each
  chunk a rank holds needs the first k positions of the chunk after it in sequence order;
- ``reduce``: a sum, mean, max, ... over the sequence (pooling), a sum of positions into bins
  (``scatter_add``): exact with an all-reduce over cp;
- ``scan``: a cumulative sum or product along the sequence: exact with an exclusive scan over cp;
- ``loss``: a loss reduced over tokens: its sum and token count all-reduced over cp;
- ``replicated``: holds no sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable

import torch.fx as fx

from autopar.passes.context_parallel.graph_util import op_key, shape
from autopar.passes.context_parallel.seq_place import Place, aligned, moved, view_place

__all__ = ["Outcome", "Refuse", "Reader", "RULES", "ELEMENTWISE", "family"]


@dataclass(frozen=True)
class Outcome:
    """What a rule decided: the output's place (None: no sequence), the rule's name and what cp does there."""

    place: Place | None
    rule: str
    note: str = ""


class Refuse(Exception):
    """cp cannot shard this node on the sequence: ``reason`` and ``fix``."""

    def __init__(self, reason: str, fix: str):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


class Reader:
    """What rules read: each node's place so far, and the operands a rule finds spanning the sequence."""

    def __init__(self, places: dict, seq_len: int):
        self.places, self.seq_len = places, seq_len
        self.positional: list[tuple[fx.Node, Place]] = []  # unsharded operands to read at global positions
        self.written: list[fx.Node] = []  # fresh buffers a sequence-sharded value was copied into

    def place(self, arg) -> Place | None:
        return self.places.get(arg) if isinstance(arg, fx.Node) else None

    def placed_args(self, node: fx.Node) -> list[tuple[fx.Node, Place]]:
        flat = []
        for a in list(node.args) + list(node.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(x, fx.Node) and self.place(x) is not None:
                    flat.append((x, self.place(x)))
        return flat


def family(node: fx.Node) -> str:
    return op_key(node).split(".")[0]


def _dim(d, rank: int) -> int:
    return d + rank if d < 0 else d


def _one(node: fx.Node, r: Reader) -> tuple[fx.Node, Place]:
    placed = r.placed_args(node)
    return placed[0]


def _follow(place: Place, rule: str = "pointwise", note: str = "") -> Outcome:
    if place.kind == "pos" and rule == "pointwise":
        return Outcome(place, "positional", note or "computed from positions alone: at the rank's global positions")
    return Outcome(place, rule, note)


def elementwise(node: fx.Node, r: Reader) -> Outcome:
    """Broadcasting ops: every sequence-holding operand must align; an unsharded operand spanning the
    sequence (a position table added as is) is read at the rank's positions."""
    out_rank = len(shape(node) or ())
    found = None
    for arg, p in r.placed_args(node):
        p = aligned(p, len(shape(arg)), out_rank)
        if found is not None and (p.dim, p.outer, p.inner, p.size) != (found.dim, found.outer, found.inner, found.size):
            raise Refuse(f"two sequence dims meet here ({found.dim} and {p.dim}): a (query x key) value outside "
                         "any recognised attention", "write the attention so that the analysis recognises it, or "
                         "build the value inside the attention's mask")
        found = p if found is None or found.kind == "pos" else found
    for arg in node.all_input_nodes:
        arg_shape = shape(arg)
        if r.place(arg) is not None or not arg_shape:
            continue
        at = found.dim - (out_rank - len(arg_shape))
        if 0 <= at < len(arg_shape) and arg_shape[at] == found.extent() and found.extent() > 1:
            r.positional.append((arg, replace(found, dim=at, kind="pos")))
    return _follow(found)


def view(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    out = view_place(p, shape(arg), shape(node))
    if out is None:
        raise Refuse(f"{node.name} cuts the sequence dim across two dims (of {shape(node)}): positions are regrouped",
                     "keep cp=1 for this model; a chunked or windowed layout of the sequence is not sharded by cp")
    return _follow(out)


def expand(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    return _follow(aligned(p, len(shape(arg)), len(shape(node))))


def transpose(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    rank = len(shape(arg))
    if family(node) == "t" or family(node) == "numpy_T":
        return _follow(moved(p, rank - 1 - p.dim))
    if family(node) == "permute":
        return _follow(moved(p, [_dim(d, rank) for d in node.args[1]].index(p.dim)))
    d0, d1 = _dim(node.args[1], rank), _dim(node.args[2], rank)
    return _follow(moved(p, d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim))


def select(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    d = _dim(node.args[1], len(shape(arg)))
    if d == p.dim:
        raise Refuse(f"{node.name} picks position {node.args[2]} of the sequence (the last token, a CLS token): "
                     "only one cp rank holds it", "pool with a mean over the sequence, or keep cp=1")
    return _follow(moved(p, p.dim - (1 if d < p.dim else 0)))


def slice_(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    size = shape(arg)
    d = _dim(node.args[1] if len(node.args) > 1 else 0, len(size))
    if d != p.dim:
        return _follow(p)
    n = size[d]
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    stop = node.args[3] if len(node.args) > 3 and node.args[3] is not None else n
    step = node.args[4] if len(node.args) > 4 else 1
    start, stop = (start + n if start < 0 else min(start, n)), (stop + n if stop < 0 else min(stop, n))
    dropped = n - (stop - start)
    if step == 1 and p.outer == p.inner == 1 and 0 < dropped < n // 2 and (start == 0 or stop == n):
        side = "first" if start else "last"
        return Outcome(replace(p, size=stop - start), "label_shift",
                       f"drops the {side} {dropped} position(s) of the sequence: a shift across chunk boundaries "
                       f"(each chunk a rank holds needs the first {dropped} of the chunk after it in sequence order)")
    raise Refuse(f"{node.name} keeps positions [{start}:{stop}:{step}] of {n}: a part of the sequence no rank holds "
                 "alone", "keep cp=1, or slice after gathering")


def pad(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    rank, pads = len(shape(arg)), list(node.args[1])
    amounts = {rank - 1 - i // 2: (pads[i], pads[i + 1]) for i in range(0, len(pads), 2)}
    low, high = amounts.get(p.dim, (0, 0))
    if (low, high) == (0, 0):
        return _follow(p)
    if low == 0 and high > 0 and p.outer == p.inner == 1:
        return Outcome(replace(p, size=p.size + high), "label_shift",
                       f"pads {high} position(s) after the sequence before a shift: only the last chunk in sequence "
                       "order is padded; every other chunk takes the first positions of the chunk after it")
    raise Refuse(f"{node.name} pads the sequence by ({low}, {high})", "keep cp=1, or pad the batch before it is cut")


def _reduced_dims(node: fx.Node, rank: int):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(rank))
    return [_dim(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


_EXACT = {"sum": "a sum: all-reduce SUM over cp", "mean": "a mean: all-reduce SUM over cp, divided by the global count",
          "amax": "all-reduce MAX over cp", "amin": "all-reduce MIN over cp", "max": "all-reduce MAX over cp",
          "min": "all-reduce MIN over cp", "any": "all-reduce MAX over cp", "all": "all-reduce MIN over cp",
          "logsumexp": "max and sum of exp all-reduced over cp", "prod": "all-reduce PRODUCT over cp",
          "var": "sum and sum of squares all-reduced over cp", "std": "sum and sum of squares all-reduced over cp",
          "norm": "the sum of |x|^p all-reduced over cp"}


def reduce(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    rank = len(shape(arg))
    dims = _reduced_dims(node, rank)
    if p.dim in dims:
        op = family(node)
        if op not in _EXACT:
            raise Refuse(f"{node.name} ({op}) reduces over the sequence", "keep cp=1 for this model")
        return Outcome(None, "reduce", f"reduces over the sequence: exact under cp with {_EXACT[op]}")
    keep = len(shape(node) or ()) == rank
    return _follow(moved(p, p.dim if keep else p.dim - sum(1 for d in dims if d < p.dim)))


def repeat_interleave(node: fx.Node, r: Reader) -> Outcome:
    """Each position repeated ``k`` times along the sequence's dim (Mixtral's router loss repeats the padding mask
    once per chosen expert): the repeats merge in after the position; along another dim the shard follows."""
    arg, p = _one(node, r)
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(repeats, int):
        raise Refuse(f"{node.name} repeats positions by a tensor of counts", "keep cp=1 for this model")
    if dim is None:  # flattened first
        p, dim = view_place(p, shape(arg), (math.prod(shape(arg)),)), 0
    if p is not None and _dim(dim, len(shape(node))) == p.dim:
        return _follow(replace(p, inner=p.inner * repeats))
    if p is None:
        raise Refuse(f"{node.name} flattens the sequence apart before repeating it", "keep cp=1 for this model")
    return _follow(p)


def scatter_sum(node: fx.Node, r: Reader) -> Outcome:
    """``out.scatter_add(dim, index, src)`` with the sequence in ``index`` and ``src`` along ``dim``: sums of positions
    into bins (Mixtral's router loss counts tokens per expert so), exact with an all-reduce SUM over cp."""
    out, dim, index, src = (node.args + (None,) * 4)[:4]
    if r.place(out) is not None:
        raise Refuse(f"{node.name} scatters into a sequence-sharded value", "keep cp=1 for this model")
    places = [r.place(a) for a in (index, src)]
    if any(p is None for p in places) or any(_dim(dim, len(shape(a))) != p.dim for a, p in zip((index, src), places)):
        raise Refuse(f"{node.name} scatters along the sequence with an index and a source not both cut on it",
                     "keep cp=1 for this model")
    if shape(node)[_dim(dim, len(shape(node)))] % places[0].size == 0:  # rows put back in token order (a combine)
        raise Refuse(f"{node.name} scatters positions into a dim as long as the sequence: not a sum into bins",
                     "keep cp=1 for this model")
    return Outcome(None, "reduce", "sums positions into bins: exact under cp with all-reduce SUM over cp")


def scan(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    if _dim(node.args[1], len(shape(arg))) != p.dim:
        return _follow(p)
    return Outcome(p, "scan", "a running sum or product along the sequence: exact under cp with an exclusive scan "
                              "(each rank adds the totals of the chunks before its own, in sequence order)")


def norm(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    normalized = node.args[1] if family(node) in ("layer_norm", "native_layer_norm", "rms_norm") else None
    rank = len(shape(arg))
    if normalized is not None and p.dim >= rank - len(normalized):
        raise Refuse(f"{node.name} normalises over the sequence", "keep cp=1 for this model")
    if family(node) in ("group_norm", "native_group_norm", "batch_norm", "instance_norm") and p.dim >= 1:
        raise Refuse(f"{node.name} ({family(node)}) takes statistics over the sequence", "keep cp=1 for this model")
    return _follow(p)


def softmax(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    if _dim(node.args[1], len(shape(arg))) == p.dim:
        raise Refuse(f"{node.name} normalises over the sequence outside any recognised attention",
                     "write the attention so that the analysis recognises it, or keep cp=1")
    return _follow(p)


def linear(node: fx.Node, r: Reader) -> Outcome:
    """Projections: the sequence must be a row (batch) dim of the activation, never the contracted dim."""
    placed = r.placed_args(node)
    if len(placed) > 1:
        raise Refuse(f"{node.name} multiplies two sequence-sharded values outside any recognised attention",
                     "write the attention so that the analysis recognises it, or keep cp=1")
    arg, p = placed[0]
    op, rank, out_rank = family(node), len(shape(arg)), len(shape(node))
    slot = next(i for i, a in enumerate(node.args) if a is arg)
    activation = 1 if op in ("addmm", "baddbmm") else 0
    if op in ("addmm", "baddbmm") and slot == 0:  # the added input, broadcast onto the product
        return _follow(aligned(p, rank, out_rank))
    if slot != activation or p.dim >= rank - 1:
        raise Refuse(f"{node.name} ({op}) contracts or mixes the sequence dim", "keep cp=1 for this model")
    return _follow(aligned(p, rank, out_rank))


def embedding(node: fx.Node, r: Reader) -> Outcome:
    """``weight[ids]``: the ids' sequence dim carries over; positions as ids read a position table."""
    weight, ids = node.args[0], node.args[1]
    if r.place(weight) is not None:
        raise Refuse(f"{node.name} looks up a table that holds the sequence", "keep cp=1 for this model")
    return _follow(r.place(ids))


def index(node: fx.Node, r: Reader) -> Outcome:
    src, indices = node.args[0], list(node.args[1])
    if r.place(src) is not None:
        p = r.place(src)
        if p.dim < len(indices) and indices[p.dim] is not None:
            raise Refuse(f"{node.name} gathers positions of the sequence by index", "keep cp=1 for this model")
        if any(i is not None for i in indices[:p.dim]) or any(r.place(i) is not None for i in indices if i is not None):
            raise Refuse(f"{node.name} indexes a sequence-sharded value in a way the analysis does not follow",
                         "keep cp=1 for this model")
        return _follow(p)
    used = [(k, i) for k, i in enumerate(indices) if i is not None]
    if len(used) == 1 and used[0][0] == 0 and r.place(used[0][1]) is not None:
        return _follow(r.place(used[0][1]))  # table[ids]: like an embedding lookup
    raise Refuse(f"{node.name} indexes with sequence-sharded indices in a way the analysis does not follow",
                 "keep cp=1 for this model")


def cat(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    d = _dim(node.args[1] if len(node.args) > 1 else 0, len(shape(node)))
    if d == p.dim:
        raise Refuse(f"{node.name} concatenates along the sequence", "keep cp=1 for this model")
    return elementwise(node, r) if family(node) == "cat" else _follow(moved(p, p.dim + (1 if p.dim >= d else 0)))


def split(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    d = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(shape(arg)))
    if family(node) == "unbind":
        d = _dim(node.args[1] if len(node.args) > 1 else 0, len(shape(arg)))
        if d != p.dim:
            return _follow(moved(p, p.dim - (1 if d < p.dim else 0)))
    if d == p.dim:
        raise Refuse(f"{node.name} splits the sequence", "keep cp=1 for this model")
    return _follow(p)


def getitem(node: fx.Node, r: Reader) -> Outcome:
    return _follow(r.place(node.args[0]))


def loss(node: fx.Node, r: Reader) -> Outcome:
    reduction = node.args[3] if family(node) in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d") \
        and len(node.args) > 3 else node.kwargs.get("reduction", 1)
    arg, p = _one(node, r)
    if reduction == 0:
        return _follow(p)
    return Outcome(None, "loss", "a loss summed over tokens: its sum (and, for a mean, its token count) all-reduced "
                                 "over cp, the count with the runtime's token count")


def refused_op(why: str, at: int, name: str = "dim", default=-1) -> Callable:
    """A rule refusing the op when its dim argument (position ``at`` or keyword ``name``, else ``default``;
    None: every dim) is the sequence, following the shard otherwise."""
    def rule(node: fx.Node, r: Reader) -> Outcome:
        arg, p = _one(node, r)
        dims = node.args[at] if len(node.args) > at else node.kwargs.get(name, default)
        rank = len(shape(arg))
        dims = list(range(rank)) if dims is None else [_dim(d, rank) for d in (
            dims if isinstance(dims, (list, tuple)) else [dims])]
        if p.dim not in dims:
            return _follow(p)
        raise Refuse(f"{node.name} ({family(node)}) {why}", "keep cp=1 for this model")
    return rule


def convolution(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    if p.dim >= 2:
        raise Refuse(f"{node.name} convolves over the sequence: each output mixes neighbouring positions, across shard "
                     "boundaries", "keep cp=1 for this model (a halo exchange of the kernel's width is not built)")
    return _follow(p)


def roll(node: fx.Node, r: Reader) -> Outcome:
    arg, p = _one(node, r)
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", [])
    dims = [_dim(d, len(shape(arg))) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if p.dim not in dims:
        return _follow(p)
    return Outcome(p, "label_shift", "rolls the sequence: a shift across shard boundaries (the rank needs its "
                                     "neighbour's positions in sequence order)")


def like(node: fx.Node, r: Reader) -> Outcome:
    """``zeros_like`` and kin: a fresh value with the operand's layout."""
    return _follow(_one(node, r)[1])


def fresh(node: fx.Node, r: Reader) -> Outcome:
    """``new_empty`` and kin read only their operand's dtype and device: a fresh value with no sequence (it takes
    one when a sequence-sharded value is copied into it)."""
    return Outcome(None, "replicated", "a fresh tensor")


def copy(node: fx.Node, r: Reader) -> Outcome:
    """``copy_(dst, src)``: the destination (and the buffer it views) takes the source's place."""
    dst, src = node.args[0], node.args[1]
    p = r.place(src) or r.place(dst)
    if r.place(dst) is None and p is not None:
        base = dst
        while isinstance(base, fx.Node) and family(base) in ("slice", "narrow", "alias") and \
                len(shape(base)) == len(shape(src)):
            r.places[base] = aligned(p, len(shape(src)), len(shape(base)))
            r.written.append(base)
            base = base.args[0]
        if isinstance(base, fx.Node) and len(shape(base) or ()) == len(shape(src)):
            r.places[base] = aligned(p, len(shape(src)), len(shape(base)))
            r.written.append(base)
        else:
            raise Refuse(f"{node.name} writes a sequence-sharded value into a view the analysis does not follow",
                         "keep cp=1 for this model")
    return _follow(aligned(p, len(shape(src)), len(shape(dst))))


ELEMENTWISE = (
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "exp", "pow", "rsqrt", "sqrt",
    "dropout", "native_dropout", "clone", "contiguous", "to", "_to_copy", "type_as", "alias", "detach", "where",
    "masked_fill", "cos", "sin", "abs", "erf", "log", "square", "reciprocal", "rsub", "maximum", "minimum", "clamp",
    "leaky_relu", "hardtanh", "softplus", "mish", "gt", "ge", "lt", "le", "eq", "ne", "__and__", "__or__",
    "bitwise_and", "bitwise_or", "bitwise_not", "logical_and", "logical_or", "logical_not", "lift_fresh_copy",
    "fill", "floor_divide", "remainder", "fmod", "sign", "floor", "ceil", "round", "log1p", "expm1", "gelu_",
    "silu_", "relu_", "add_", "mul_", "div_", "sub_", "erfinv", "atan", "sinh", "cosh", "hardswish", "hardsigmoid",
    "elu", "selu", "celu", "masked_fill_",
)

RULES: "MappingProxyType[str, Callable]" = MappingProxyType({
    **{name: elementwise for name in ELEMENTWISE},
    "log_softmax": softmax, "_log_softmax": softmax, "softmax": softmax, "_softmax": softmax,
    "view": view, "view_as": view, "reshape": view, "_unsafe_view": view, "flatten": view, "unflatten": view, "unsqueeze": view,
    "squeeze": view, "expand": expand, "expand_as": expand, "broadcast_to": expand,
    "transpose": transpose, "t": transpose, "permute": transpose, "numpy_T": transpose,
    "select": select, "slice": slice_, "narrow": slice_, "constant_pad_nd": pad, "pad": pad,
    **{name: reduce for name in _EXACT}, "argmax": refused_op("takes an index over the sequence", 1, default=None),
    "argmin": refused_op("takes an index over the sequence", 1, default=None),
    "cumsum": scan, "cumprod": scan, "logcumsumexp": scan, "cummax": scan, "cummin": scan,
    "layer_norm": norm, "native_layer_norm": norm, "rms_norm": norm, "group_norm": norm, "native_group_norm": norm,
    "batch_norm": norm, "instance_norm": norm, "_native_batch_norm_legit_functional": norm,
    "_native_batch_norm_legit_no_training": norm,
    "linear": linear, "addmm": linear, "mm": linear, "matmul": linear, "bmm": linear, "baddbmm": linear,
    "embedding": embedding, "index": index, "cat": cat, "stack": cat,
    "split": split, "split_with_sizes": split, "chunk": split, "unbind": split, "getitem": getitem,
    "cross_entropy_loss": loss, "nll_loss": loss, "nll_loss_nd": loss, "nll_loss2d": loss, "mse_loss": loss,
    "l1_loss": loss, "smooth_l1_loss": loss, "binary_cross_entropy": loss, "binary_cross_entropy_with_logits": loss,
    "kl_div": loss, "huber_loss": loss,
    "convolution": convolution, "conv1d": convolution, "conv2d": convolution,
    "sort": refused_op("sorts along the sequence", 1), "argsort": refused_op("sorts along the sequence", 1),
    "topk": refused_op("ranks positions along the sequence", 2), "kthvalue": refused_op("ranks along the sequence", 2),
    "median": refused_op("ranks along the sequence", 1, default=None), "flip": refused_op("reverses the sequence", 1, "dims"),
    "gather": refused_op("gathers along the sequence", 1), "scatter": refused_op("scatters along the sequence", 1),
    "repeat_interleave": repeat_interleave, "scatter_add": scatter_sum, "scatter_add_": scatter_sum,
    "index_select": refused_op("gathers positions along the sequence", 1), "roll": roll,
    "zeros_like": like, "ones_like": like, "empty_like": like, "full_like": like, "rand_like": like,
    "randn_like": like, "copy_": copy, "copy": copy,
    "new_empty": fresh, "new_zeros": fresh, "new_ones": fresh, "new_full": fresh, "new_empty_strided": fresh,
})
