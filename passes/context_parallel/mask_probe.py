"""What an attention's mask and bias terms do, found by running the graph that builds them on probes.

Families build masks in many ways (an ``arange`` comparison vmapped over batch and heads, a tril
buffer, ``(1 - mask) * min``, ALiBi slopes times a cumulative sum of the padding mask, ...). Instead of
matching each way, the terms' own subgraph (their ancestors: inputs, buffers, ``arange`` and other
constants) is copied out and evaluated on probe inputs, and what comes out is read:

- *pattern* on neutral inputs (no padding, positions 0..S-1): ``full``, ``causal``, ``window`` (causal
  with transformers' sliding window: ``q - k < window``) or ``dense`` (anything else);
- *padding*: an input whose zeros (row 0's last two tokens set to 0) mask exactly those keys;
- *documents*: a positions input whose restart (row 0 = two runs 0..S/2-1) splits the row into two
  documents that do not see each other;
- *bias* on the visible pairs: ``none``, ``alibi`` (linear in the key's position with one slope per head;
  the slopes recorded) or ``other``; ``learned`` when the term reads a parameter.

Neutral probe values: an input named like ``*mask*`` is all ones, one named like ``*position*`` counts
0..S-1, another integer input draws token ids from 2..49 (a seeded generator), a float input is zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir.meta_keys import MaskInfo
from autopar.passes.context_parallel.graph_util import ancestors, is_op, param_of, shape, value

__all__ = ["Term", "Frame", "probe_terms", "classify_visible"]

_LOW = -1e30  # an additive entry at or below this masks its pair (transformers writes the dtype's lowest value)


@dataclass(frozen=True)
class Term:
    """One mask or bias the scores meet: its node, how (``add``; ``keep``: True may meet; ``drop``: True is
    masked) and the shape of the scores where it is combined (broadcast target)."""

    node: fx.Node
    how: str
    at_shape: tuple[int, ...]


@dataclass(frozen=True)
class Frame:
    """The attention's sizes: batch, query heads, query and key lengths."""

    batch: int
    heads: int
    q_len: int
    k_len: int


def _subgraph(gm: fx.GraphModule, terms: list[fx.Node]):
    """(a GraphModule computing the terms from their leaf inputs, the leaf placeholders in its input order)."""
    needed = ancestors(terms)
    graph, env, leaves = fx.Graph(), {}, []
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            leaves.append(node)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[t] for t in terms))
    return fx.GraphModule(gm, graph), leaves


def _neutral(leaf: fx.Node, gen: torch.Generator) -> torch.Tensor:
    val = value(leaf)
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"input {leaf.name} has no recorded example value")
    shp, dtype = tuple(val.shape), val.dtype
    name = leaf.name.lower()
    if dtype.is_floating_point:
        return torch.zeros(shp, dtype=dtype)
    if "position" in name and shp:
        return torch.arange(shp[-1]).expand(shp).to(dtype).clone()
    if "mask" in name or dtype == torch.bool:
        return torch.ones(shp, dtype=dtype)
    return torch.randint(2, 50, shp, generator=gen).to(dtype)


def _visible_and_bias(out: torch.Tensor, term: Term, frame: Frame):
    """(visible [B, H, Sq, Sk] bool, additive bias on visible pairs [B, H, Sq, Sk] float or None)."""
    full = torch.broadcast_to(out, term.at_shape).reshape(frame.batch, frame.heads, frame.q_len, frame.k_len)
    if full.dtype == torch.bool:
        return (full if term.how != "drop" else ~full), None
    if term.how in ("keep", "drop"):  # a 0/1 tensor used as a condition
        keep = full != 0
        return (keep if term.how == "keep" else ~keep), None
    visible = full > _LOW
    return visible, torch.where(visible, full.double(), torch.zeros((), dtype=torch.float64))


def classify_visible(visible: torch.Tensor, frame: Frame) -> tuple[str, int | None]:
    """(pattern, window) of a [B, H, Sq, Sk] visibility: full, causal, window (with its size) or dense."""
    qi = torch.arange(frame.q_len).view(-1, 1) + (frame.k_len - frame.q_len)
    ki = torch.arange(frame.k_len).view(1, -1)
    if bool(visible.all()):
        return "full", None
    causal = ki <= qi
    if bool((visible == causal).all()):
        return "causal", None
    seen = (qi - ki).expand_as(visible[0, 0])[visible.any(dim=(0, 1))]
    window = int(seen.max()) + 1 if seen.numel() else 0
    if 0 < window < frame.k_len and bool((visible == (causal & (qi - ki < window))).all()):
        return "window", window
    return "dense", None


def _alibi_slopes(bias: torch.Tensor, visible: torch.Tensor) -> tuple[float, ...] | None:
    """One slope per head when the bias rises linearly with the key's position over every visible pair."""
    steps = bias[..., 1:] - bias[..., :-1]
    both = visible[..., 1:] & visible[..., :-1]
    slopes = []
    for h in range(bias.shape[1]):
        seen = steps[:, h][both[:, h]]
        if not seen.numel() or float(seen.max() - seen.min()) > 1e-6 * max(1.0, float(seen.abs().max())):
            return None
        slopes.append(float(seen[0]))
    return tuple(slopes) if any(s != 0 for s in slopes) else None


def _sources(gm: fx.GraphModule, term: fx.Node, leaves: list[fx.Node]) -> tuple[str, ...]:
    """The inputs, parameters and position producers (``arange``, ``cumsum``) a term is built from."""
    found, reads = [leaf.name for leaf in leaves], ancestors([term])
    for node in gm.graph.nodes:
        if node in reads:
            if param_of(gm, node) is not None:
                found.append(node.target)
            elif is_op(node, "arange", "cumsum"):
                found.append(node.name)
    return tuple(dict.fromkeys(found))


def _run(probe: fx.GraphModule, leaves, values: dict) -> tuple:
    with torch.no_grad():
        return probe(*[values[leaf] for leaf in leaves])


def _input_effect(probe, leaves, base, terms, frame, which, name, change, expect) -> bool:
    """Whether changing input ``name`` (``change(tensor)``) turns term ``which``'s visibility into ``expect``."""
    values = dict(base)
    leaf = next(lf for lf in leaves if lf.name == name)
    values[leaf] = change(values[leaf].clone())
    out = _run(probe, leaves, values)[which]
    return bool((_visible_and_bias(out, terms[which], frame)[0] == expect).all())


def _combined(outs, terms, frame) -> torch.Tensor:
    vis = torch.ones(frame.batch, frame.heads, frame.q_len, frame.k_len, dtype=torch.bool)
    for out, term in zip(outs, terms):
        vis &= _visible_and_bias(out, term, frame)[0]
    return vis


def probe_terms(gm: fx.GraphModule, terms: list[Term], frame: Frame):
    """(MaskInfo per term, the combined visibility on neutral inputs) or (None, why) when they cannot be run."""
    probe, leaves = _subgraph(gm, [t.node for t in terms])
    gen = torch.Generator().manual_seed(0)
    try:
        base = {leaf: _neutral(leaf, gen) for leaf in leaves}
        outs = _run(probe, leaves, base)
    except Exception as exc:  # noqa: BLE001 - a meta buffer, a data-dependent op: the mask stays unread
        return None, f"the mask could not be evaluated on probe inputs ({type(exc).__name__}: {str(exc)[:120]})"
    infos = []
    for which, (out, term) in enumerate(zip(outs, terms)):
        visible, bias = _visible_and_bias(out, term, frame)
        pattern, window = classify_visible(visible, frame)
        probes = (probe, leaves, base, terms, frame, which, visible)
        learned = any(param_of(gm, n) is not None for n in ancestors([term.node]))
        slopes = _alibi_slopes(bias, visible) if bias is not None else None
        kind = "learned" if learned else "none" if bias is None or not bool(bias.any()) else \
            "alibi" if slopes else "other"
        infos.append(MaskInfo(node=term.node.name, how=term.how, sources=_sources(gm, term.node, leaves),
                              pattern=pattern, window=window, padding=_padding(*probes),
                              documents=_documents(*probes), bias=kind, alibi_slopes=slopes if kind == "alibi" else ()))
    return tuple(infos), _combined(outs, terms, frame)


def _padding(probe, leaves, base, terms, frame, which, vis) -> str | None:
    """The input whose zeros mask exactly those keys (row 0's last two set to 0)."""
    for leaf in leaves:
        shp, val = shape(leaf), value(leaf)
        if not shp or len(shp) != 2 or shp[1] != frame.k_len or val.dtype.is_floating_point:
            continue
        padded = torch.ones(frame.k_len, dtype=torch.bool)
        padded[-2:] = False
        expect = vis.clone()
        expect[0] &= padded.view(1, 1, -1)

        def change(t):
            t[0, -2:] = 0
            return t
        if not bool((expect == vis).all()) and _input_effect(probe, leaves, base, terms, frame, which, leaf.name,
                                                             change, expect):
            return leaf.name
    return None


def _documents(probe, leaves, base, terms, frame, which, vis) -> str | None:
    """The positions input whose restart (two documents in row 0) keeps the documents apart."""
    half = frame.k_len // 2
    for leaf in leaves:
        shp, val = shape(leaf), value(leaf)
        if "position" not in leaf.name.lower() or not shp or shp[-1] != frame.k_len or half < 1:
            continue
        doc = (torch.arange(frame.k_len) >= half)
        expect = vis.clone()
        expect[0] &= (doc.view(-1, 1) == doc.view(1, -1))[-frame.q_len:].view(1, frame.q_len, frame.k_len)

        def change(t, dtype=val.dtype):
            t[0] = torch.cat([torch.arange(half), torch.arange(frame.k_len - half)]).to(dtype)
            return t
        if not bool((expect == vis).all()) and _input_effect(probe, leaves, base, terms, frame, which, leaf.name,
                                                             change, expect):
            return leaf.name
    return None
