"""Analysis: find every attention of a captured graph, whatever the family writes, and what it computes.

Two forms are recognised from the dataflow, not from module names:

- **sdpa**: ``aten.scaled_dot_product_attention`` (and the kernels it lowers to on export:
  ``_scaled_dot_product_flash_attention_for_cpu``, ``_flash_attention``, ``_efficient_attention``),
  its mask argument, ``is_causal``, ``scale``, ``dropout_p`` and ``enable_gqa`` read off the call;
- **eager**: a ``softmax`` over the last dim whose input is a chain from a product of two activations
  (``matmul``, ``bmm``, ``baddbmm``, ``einsum`` of q and k^T) through casts, views, a scale (``mul``
  or ``div`` by a number, ``baddbmm``'s alpha), soft-capping (``c * tanh(s / c)``), additive terms
  (``add``, ``baddbmm``'s input) and boolean masks (``masked_fill``, ``where``), followed by an optional
  dropout and a product with v.

For each one: q, k (before its transpose), v and their layouts; the heads and kv heads (a k repeated
from fewer heads by ``expand``/``reshape``, ``repeat_interleave`` or broadcasting is grouped-query
attention, its source recorded); a latent kv (MLA: k made by an up projection of a low-rank down
projection); scale, soft-cap and dropout; and each mask or bias term, evaluated on probes by
:mod:`~autopar.passes.context_parallel.mask_probe` (causal, sliding window, padding, packed documents,
ALiBi slopes). A softmax over a product of activations that does not fit, or a mask that cannot be
evaluated, is reported with the node, its module path and why.

Example::

    >>> import torch
    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> report = find_attention(gm)
    >>> [(a.path, a.form, a.causal, a.num_heads, a.q_layout.seq) for a in report.found][:1]
    [('model.blocks.0.attn', 'sdpa', True, 4, 2)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir.meta_keys import ATTENTION, AttentionInfo, AttnLayout, set_meta
from autopar.passes.frontend.annotate import module_path_of
from autopar.passes.context_parallel.graph_util import is_op, op_key, param_of, scalar, shape
from autopar.passes.context_parallel.mask_probe import Frame, Term, classify_visible, probe_terms

__all__ = ["Unrecognised", "AttentionReport", "find_attention", "annotate_attention"]

_CASTS = ("to", "_to_copy", "alias", "contiguous", "clone", "type_as", "detach", "view", "reshape", "_unsafe_view",
          "lift_fresh_copy")
_SOFTMAX = ("softmax", "_softmax", "_safe_softmax")
_PRODUCTS = ("matmul", "bmm", "baddbmm", "einsum")
_DROPOUT = ("dropout", "native_dropout", "feature_dropout")
# SDPA and the kernels export may lower it to: (dropout arg index, causal arg index, mask: arg index or kwarg)
_SDPA = {"scaled_dot_product_attention": (4, 5, 3), "_scaled_dot_product_flash_attention_for_cpu": (3, 4, "attn_mask"),
         "_scaled_dot_product_flash_attention": (3, 4, None), "_scaled_dot_product_efficient_attention": (5, 6, 3)}
_UNSUPPORTED = ("flex_attention", "_scaled_dot_product_cudnn_attention", "_fused_sdp_choice")


@dataclass(frozen=True)
class Unrecognised:
    """An attention-like computation the analysis could not read: where, and why."""

    node: str
    path: str
    reason: str


@dataclass(frozen=True)
class AttentionReport:
    """What :func:`find_attention` found (in graph order) and what it could not read."""

    found: tuple[AttentionInfo, ...]
    unrecognised: tuple[Unrecognised, ...]


class _Miss(Exception):
    """This softmax or call is not an attention the analysis can read (the message says why)."""


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _layout(node: fx.Node, *, transposed: bool = False) -> AttnLayout:
    rank = len(shape(node) or ())
    if rank == 4:
        heads, batch = 1, 0
    elif rank == 3:
        heads = batch = 0
    else:
        raise _Miss(f"operand {node.name} has {rank} dims; attention operands of 3 (batch x heads, seq, features) "
                    "or 4 (batch, heads, seq, features) dims are read")
    seq, feature = (rank - 1, rank - 2) if transposed else (rank - 2, rank - 1)
    return AttnLayout(batch=batch, heads=heads, seq=seq, feature=feature)


def _untranspose(kt: fx.Node) -> tuple[fx.Node, bool]:
    """(k, whether ``kt`` is k with its last two dims swapped) for the second operand of ``q @ kt``."""
    node = kt
    while op_key(node).split(".")[0] in ("contiguous", "clone", "alias"):
        node = node.args[0]
    rank = len(shape(node) or ())
    if is_op(node, "transpose") and sorted(d % rank for d in node.args[1:3]) == [rank - 2, rank - 1]:
        return node.args[0], True
    if is_op(node, "permute") and [d % rank for d in node.args[1]] == list(range(rank - 2)) + [rank - 1, rank - 2]:
        return node.args[0], True
    return kt, False


@dataclass
class _Chain:
    """What the walk from a softmax up to the scores product collected."""

    scale: float = 1.0
    softcap: float | None = None
    terms: list = None
    nodes: list = None


def _is_activation(gm: fx.GraphModule, node) -> bool:
    return isinstance(node, fx.Node) and param_of(gm, node) is None and node.op != "get_attr" and shape(node) is not None


def _softcap(node: fx.Node) -> tuple[float, fx.Node, list] | None:
    """``c * tanh(x / c)`` (or ``tanh(x * (1/c)) * c``) ending at ``node``: (c, x, its nodes)."""
    if not is_op(node, "mul"):
        return None
    t, c = node.args[0], scalar(node.args[1])
    if c is None:
        t, c = node.args[1], scalar(node.args[0])
    if c is None or not is_op(t, "tanh"):
        return None
    inner = t.args[0]
    if is_op(inner, "div") and scalar(inner.args[1]) is not None and math.isclose(scalar(inner.args[1]), c):
        return c, inner.args[0], [node, t, inner]
    if is_op(inner, "mul") and scalar(inner.args[1]) is not None and math.isclose(scalar(inner.args[1]) * c, 1.0):
        return c, inner.args[0], [node, t, inner]
    return None


def _reaches_product(gm, node, depth: int = 12) -> bool:
    """Whether walking up the score chain from ``node`` meets a product of two activations."""
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        if is_op(node, *_PRODUCTS):
            ops = node.args[1] if is_op(node, "einsum") else node.args[1:3] if is_op(node, "baddbmm") else node.args[:2]
            return all(_is_activation(gm, o) for o in ops)
        node = next((a for a in node.args if isinstance(a, fx.Node) and _is_activation(gm, a)), None)
    return False


def _walk_scores(gm, softmax: fx.Node) -> tuple[fx.Node, _Chain]:
    """Up from the softmax's input to the scores product, collecting scale, soft-cap and mask terms."""
    chain = _Chain(terms=[], nodes=[])
    node = softmax.args[0]
    while True:
        chain.nodes.append(node)
        key = op_key(node).split(".")[0]
        capped = _softcap(node)
        if capped is not None:
            chain.softcap, node = capped[0], capped[1]
            chain.nodes.extend(capped[2][1:])
        elif key in _PRODUCTS:
            return node, chain
        elif key in _CASTS:
            node = node.args[0]
        elif key in ("mul", "div") and scalar(node.args[1]) is not None:
            chain.scale = chain.scale * scalar(node.args[1]) if key == "mul" else chain.scale / scalar(node.args[1])
            node = node.args[0]
        elif key == "add" and len(node.args) >= 2 and all(isinstance(a, fx.Node) for a in node.args[:2]):
            score = node.args[0] if _reaches_product(gm, node.args[0]) else node.args[1]
            other = node.args[1] if score is node.args[0] else node.args[0]
            if _reaches_product(gm, other):
                raise _Miss(f"{node.name} adds two products of activations before the softmax")
            chain.terms.append(Term(other, "add", shape(node)))
            node = score
        elif key == "masked_fill":
            _fill_must_mask(node, node.args[2])
            chain.terms.append(Term(node.args[1], "drop", shape(node)))
            node = node.args[0]
        elif key == "where" and _reaches_product(gm, node.args[1]):
            _fill_must_mask(node, node.args[2])
            chain.terms.append(Term(node.args[0], "keep", shape(node)))
            node = node.args[1]
        elif key == "where" and _reaches_product(gm, node.args[2]):
            _fill_must_mask(node, node.args[1])
            chain.terms.append(Term(node.args[0], "drop", shape(node)))
            node = node.args[2]
        else:
            raise _Miss(f"the scores pass through {op_key(node) or getattr(node, 'op', node)} "
                        f"({getattr(node, 'name', node)}) before the softmax, which the analysis does not read")


def _fill_must_mask(node: fx.Node, fill) -> None:
    value = scalar(fill)
    if value is None or value > -1e30:
        raise _Miss(f"{node.name} fills scores with {fill!r}, not with a masking value (-inf or the dtype's lowest)")


def _product_operands(node: fx.Node, chain: _Chain) -> tuple[fx.Node, fx.Node, bool]:
    """(q, k, whether k is stored transposed) of the scores product; baddbmm's input joins the terms."""
    if is_op(node, "einsum"):
        equation, (q, k) = node.args[0].replace(" ", ""), node.args[1]
        ins, out = equation.split("->")
        a, b = ins.split(",")
        if a[-1] != b[-1] or out[-1] != b[-2] or out[-2] != a[-2]:
            raise _Miss(f"einsum {equation!r} is not q . k over their last dim")
        return q, k, False
    if is_op(node, "baddbmm"):
        beta, alpha = _arg(node, 3, "beta", 1), _arg(node, 4, "alpha", 1)
        chain.scale *= float(alpha)
        if float(beta) != 0:
            if float(beta) != 1:
                raise _Miss(f"{node.name} weights its added input by beta={beta}")
            chain.terms.append(Term(node.args[0], "add", shape(node)))
        q, kt = node.args[1], node.args[2]
    else:
        q, kt = node.args[0], node.args[1]
    k, transposed = _untranspose(kt)
    return q, k, not transposed


def _values_product(softmax: fx.Node) -> tuple[fx.Node, float, list]:
    """(the product of the probabilities with v, the dropout probability, the nodes between)."""
    node, p, between = softmax, 0.0, []
    while True:
        users = list(node.users)
        if len(users) != 1:
            raise _Miss(f"the attention probabilities ({node.name}) are read by {len(users)} nodes "
                        f"({', '.join(u.name for u in users)}); only a product with v is expected "
                        "(attention weights returned, output_attentions=True?)")
        user = users[0]
        key = op_key(user).split(".")[0]
        if key in _DROPOUT:
            train = _arg(user, 2, "train", True)
            p = float(_arg(user, 1, "p", 0.0)) if train else 0.0
        elif key in ("matmul", "bmm") and user.args[0] is node:
            return user, p, between
        elif key == "einsum" and user.args[1][0] is node:
            return user, p, between
        elif key == "getitem" or key not in _CASTS:
            raise _Miss(f"the attention probabilities reach {op_key(user)} ({user.name}) before any product with v")
        between.append(user)
        node = user


def _kv_source(k: fx.Node, heads: int) -> tuple[fx.Node | None, int]:
    """(the k before a grouped-query repeat, the kv heads) walking up through expand/reshape/repeat."""
    node, repeated = k, False
    for _ in range(8):
        shp = shape(node) or ()
        kv = shp[1] if len(shp) == 4 else None
        if kv is not None and kv < heads:
            return (node if repeated else None), kv
        if not isinstance(node, fx.Node) or op_key(node).split(".")[0] not in (
                "expand", "reshape", "view", "_unsafe_view", "unsqueeze", "clone", "contiguous",
                "repeat_interleave", "repeat", "index_select"):
            break
        repeated = repeated or is_op(node, "expand", "repeat_interleave", "repeat", "index_select")
        node = node.args[0]
    return None, heads


def _heads(q: fx.Node, output: fx.Node) -> int:
    """The query heads: q's heads dim; for a batch x heads operand, the heads of the 4-D value it was merged
    from (or that its output is split back into); 1 when neither exists (single-head batched attention)."""
    shp = shape(q)
    if len(shp) == 4:
        return shp[1]

    def split(four, three):
        return four and len(four) == 4 and four[0] * four[1] == three[0] and tuple(four[2:]) == tuple(three[1:])
    node = q
    for _ in range(6):
        if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
            break
        node = node.args[0]
        if split(shape(node), shp):
            return shape(node)[1]
    out = shape(output)
    for user in output.users:
        if split(shape(user), out):
            return shape(user)[1]
    return 1


def _projection_input(gm, node: fx.Node) -> fx.Node | None:
    """The activation a linear projection (a parameter weight) reads, or None when ``node`` is none."""
    key = op_key(node).split(".")[0]
    if key not in ("linear", "matmul", "mm", "addmm"):
        return None
    acts = [a for a in node.args if isinstance(a, fx.Node) and _is_activation(gm, a) and not _weight_like(gm, a)]
    weights = [a for a in node.args if isinstance(a, fx.Node) and _weight_like(gm, a)]
    return acts[0] if weights and len(acts) == 1 else None


def _weight_like(gm, node: fx.Node) -> bool:
    while is_op(node, "t", "numpy_T", "transpose", "permute"):
        node = node.args[0]
    return param_of(gm, node) is not None


def _latent(gm, k: fx.Node) -> str | None:
    """The compressed kv of a low-rank down projection that k's up projection reads (MLA), if any."""
    node, found_up = k, None
    for _ in range(40):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        inner = _projection_input(gm, node)
        if inner is not None and found_up is None:
            found_up, node = node, inner
            continue
        if inner is not None:
            return node.name  # a second projection before any residual: the down projection
        if is_op(node, "add") and sum(_is_activation(gm, a) for a in node.args[:2]) == 2 and found_up is not None:
            return None  # a residual add: the projection reads the stream, not a latent
        if is_op(node, "embedding"):
            return None
        nxt = [a for a in node.args if isinstance(a, fx.Node) and a.op == "call_function"]
        if not nxt:
            return None
        node = nxt[0]
    return None


def _frame(q: fx.Node, k: fx.Node, k_transposed: bool, heads: int, batch_heads_first: bool) -> Frame:
    qs, ks = shape(q), shape(k)
    q_len = qs[-2]
    k_len = ks[-1] if k_transposed else ks[-2]
    batch = qs[0] if not batch_heads_first else qs[0] // heads
    return Frame(batch=batch, heads=heads, q_len=q_len, k_len=k_len)


def _masks(gm, terms: list[Term], frame: Frame, is_causal: bool):
    """(MaskInfo per term, causal, window) of the terms together with SDPA's ``is_causal``."""
    if not terms:
        return (), is_causal, None
    infos, vis = probe_terms(gm, terms, frame)
    if infos is None:
        raise _Miss(vis)
    if is_causal:
        qi = torch.arange(frame.q_len).view(-1, 1) + (frame.k_len - frame.q_len)
        vis = vis & (torch.arange(frame.k_len).view(1, -1) <= qi)
    pattern, window = classify_visible(vis, frame)
    return infos, pattern in ("causal", "window"), window


def _info(gm, *, form, output, q, k, v, k_transposed, scale, softcap, dropout, terms, is_causal, nodes):
    """The AttentionInfo of one attention (its masks probed), or raise _Miss."""
    q_layout, k_layout, v_layout = _layout(q), _layout(k, transposed=k_transposed), _layout(v)
    for name, operand in (("q", q), ("k", k), ("v", v)):
        if not _is_activation(gm, operand):
            raise _Miss(f"the attention's {name} ({getattr(operand, 'name', operand)}) is not an activation")
    heads = _heads(q, output)
    source, kv_heads = _kv_source(k, heads)
    frame = _frame(q, k, k_transposed, heads, q_layout.heads == q_layout.batch)
    masks, causal, window = _masks(gm, terms, frame, is_causal)
    head_dim = shape(q)[q_layout.feature]
    return AttentionInfo(
        path=module_path_of(output), form=form, output=output.name, q=q.name, k=k.name, v=v.name,
        q_layout=q_layout, k_layout=k_layout, v_layout=v_layout, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, v_head_dim=shape(v)[v_layout.feature],
        scale=scale if scale is not None else 1.0 / math.sqrt(head_dim), causal=causal, window=window,
        softcap=softcap, dropout=dropout, masks=masks, nodes=tuple(n.name for n in nodes),
        kv_source=source.name if source is not None else None, latent=_latent(gm, source or k))


def _eager(gm, softmax: fx.Node) -> AttentionInfo:
    rank = len(shape(softmax) or ())
    dim = _arg(softmax, 1, "dim")
    if dim is None or dim % max(rank, 1) != rank - 1:
        raise _Miss(f"{softmax.name} normalises over dim {dim}, not over the keys (the last dim)")
    product, chain = _walk_scores(gm, softmax)
    q, k, k_transposed = _product_operands(product, chain)
    output, dropout, between = _values_product(softmax)
    v = output.args[1] if not is_op(output, "einsum") else output.args[1][1]
    kt = product.args[2] if is_op(product, "baddbmm") else product.args[1] if not is_op(product, "einsum") else None
    own = [kt] if kt is not None and kt is not k and len(kt.users) == 1 else []
    nodes = [product, *own, *chain.nodes, softmax, *between, output]
    return _info(gm, form="eager", output=output, q=q, k=k, v=v, k_transposed=k_transposed, scale=chain.scale,
                 softcap=chain.softcap, dropout=dropout, terms=chain.terms, is_causal=False,
                 nodes=[n for n in gm.graph.nodes if n in set(nodes)])


def _sdpa(gm, node: fx.Node) -> AttentionInfo:
    p_at, causal_at, mask_at = _SDPA[op_key(node).split(".")[0]]
    q, k, v = node.args[:3]
    mask = node.kwargs.get(mask_at) if isinstance(mask_at, str) else _arg(node, mask_at, "attn_mask") \
        if mask_at is not None else None
    dropout = float(_arg(node, p_at, "dropout_p", 0.0) or 0.0)
    is_causal = bool(_arg(node, causal_at, "is_causal", False))
    output = node
    if isinstance(node.meta.get("val"), (tuple, list)):  # a kernel returning (out, logsumexp, ...)
        output = next((u for u in node.users if is_op(u, "getitem") and u.args[1] == 0), node)
    qs, ks = shape(q), shape(k)
    at = (qs[0], qs[1], qs[2], ks[2]) if qs and ks and len(qs) == 4 else qs
    terms = [Term(mask, "keep" if shape(mask) is not None and mask.meta["val"].dtype == torch.bool else "add", at)] \
        if isinstance(mask, fx.Node) else []
    return _info(gm, form="sdpa", output=output, q=q, k=k, v=v, k_transposed=False, scale=node.kwargs.get("scale"),
                 softcap=None, dropout=dropout, terms=terms, is_causal=is_causal,
                 nodes=[node] + ([output] if output is not node else []))


def _is_candidate(gm, softmax: fx.Node) -> bool:
    """A softmax over a product of two activations (an attention); a router's softmax over a linear is not."""
    return _reaches_product(gm, softmax.args[0], depth=16)


def find_attention(gm: fx.GraphModule) -> AttentionReport:
    """Every attention of ``gm`` (graph order), and every attention-like node it could not read, with why."""
    found, missed = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        family = op_key(node).split(".")[0]
        if family in _SDPA or (family in _SOFTMAX and _is_candidate(gm, node)):
            try:
                found.append(_sdpa(gm, node) if family in _SDPA else _eager(gm, node))
            except _Miss as miss:
                missed.append(Unrecognised(node.name, module_path_of(node), str(miss)))
        elif family in _UNSUPPORTED or "flex_attention" in str(node.target):
            missed.append(Unrecognised(node.name, module_path_of(node),
                                       f"{op_key(node) or node.target} is not read yet (SDPA and eager attention are)"))
    return AttentionReport(found=tuple(found), unrecognised=tuple(missed))


def annotate_attention(gm: fx.GraphModule) -> AttentionReport:
    """Write ``autopar.attention`` on the output node of every attention :func:`find_attention` finds."""
    report = find_attention(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for info in report.found:
        set_meta(by_name[info.output], ATTENTION, info)
    return report
