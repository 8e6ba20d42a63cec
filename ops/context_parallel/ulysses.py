"""All-to-all (Ulysses) attention over the cp ranks: sequence shards become head shards and back.

DeepSpeed-Ulysses' exchange: each rank holds every head of its sequence shard; one all-to-all gives it
``H / cp`` heads of the whole sequence, it computes attention on them (an attention with no rule beyond causal:
one fused SDPA call over the sequence put back in global order; any other: ring.py's blockwise kernel), and a
second all-to-all gives every rank back all heads of its own shard::

    before (rank r: all heads of its positions)        after the first all-to-all (rank r: its heads, every position)
           positions ->                                           positions ->
           [ p0 | p1 | p2 | p3 ]                                   [ p0 | p1 | p2 | p3 ]
    heads  r0  r1   r2   r3         ---- all-to-all --->   heads   r0   r0   r0   r0    heads h in [r*H/cp, (r+1)*H/cp)
      |    r0  r1   r2   r3                                          (from r0, r1, r2, r3)
      v    (each rank a column)                                     (each rank a row)

The gathered sequence is in *layout order* (rank 0's shard, rank 1's, ...; with the load-balanced
layout not the global order): the blockwise kernel builds masks from each token's global position
(:func:`~autopar.ops.context_parallel.block_math.visible`), so it needs no reordering; the one SDPA call of
a plain causal attention runs on the sequence put back in global order and returns its output in layout order.

Needs the query heads to divide by cp (the heads a tp rank holds, under tp); kv heads divide by cp,
or cp by them (each kv head is then repeated to ``cp / Hkv`` ranks, multi-query included). The
dense ``bias`` is this rank's query rows against every key in global order, ``[B|1, H|1, L|1, seq]``:
per-head rows take the same all-to-all as q, shared rows are all-gathered. gloo on torch 2.13 has
``all_to_all_single``; the exchange uses it on every backend. Dropout is refused, as for the ring.

Example (a world of one: both exchanges are the identity)::

    >>> from autopar.ops.context_parallel.block_math import AttentionSpec
    >>> from autopar.ops.context_parallel.layout import CpLayout
    >>> a2a = UlyssesAttention(axis="cp", size=1, layout=CpLayout(seq_len=8, cp=1),
    ...                        spec=AttentionSpec(scale=0.5, causal=True))
    >>> a2a.extra_repr()
    "axis='cp', size=1, seq_len=8, load_balanced=True, causal=True"
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.ops.collectives import Comm, GraphCollective, all_gather_dim, issue, reduce_scatter_dim
from autopar.ops.context_parallel.block_math import (AttentionSpec, KeyBlock, bias_block, block_scores, grouped,
                                                          rank_flops, visible)
from autopar.ops.context_parallel.layout import CpLayout
from autopar.ops.context_parallel.ring import blockwise_attention

__all__ = ["UlyssesAttention", "ulysses_attention", "ulysses_plain", "dense_attention", "seq_to_heads", "heads_to_seq"]


def _exchange(x: torch.Tensor, group, guard, purpose: str) -> torch.Tensor:
    """All-to-all over dim 0 (``[cp, ...]``: piece j goes to rank j; piece j of the result came from rank j)."""
    x = x.contiguous()
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x
    out = torch.empty_like(wire)
    issue("all_to_all", dist.all_to_all_single, out, wire, group=group, guard=guard, purpose=purpose)
    return out.to(torch.bool) if x.dtype == torch.bool else out


def _s2h(x, size, group, guard, purpose):
    b, h, length, d = x.shape
    pieces = x.reshape(b, size, h // size, length, d).permute(1, 0, 2, 3, 4)
    got = _exchange(pieces, group, guard, purpose)  # [cp (source rank), B, H/cp, L, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * length, d)


def _h2s(y, size, group, guard, purpose):
    b, hl, total, d = y.shape
    pieces = y.reshape(b, hl, size, total // size, d).permute(2, 0, 1, 3, 4)
    got = _exchange(pieces, group, guard, purpose)  # [cp (source rank: its heads), B, H/cp, L, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, size * hl, total // size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size, group, guard, purpose):
        ctx.args = (size, group, guard, purpose)
        return _s2h(x, size, group, guard, purpose)

    @staticmethod
    def backward(ctx, grad):
        return _h2s(grad, *ctx.args), None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, size, group, guard, purpose):
        ctx.args = (size, group, guard, purpose)
        return _h2s(y, size, group, guard, purpose)

    @staticmethod
    def backward(ctx, grad):
        return _s2h(grad, *ctx.args), None, None, None, None


class _GatherRows(torch.autograd.Function):
    """All-gather on ``dim`` forward; the gradient reduce-scattered back (every rank read every piece)."""

    @staticmethod
    def forward(ctx, x, dim, group, guard, purpose):
        ctx.args = (dim, group, guard, purpose)
        return all_gather_dim(x, dim, group, guard, purpose)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, *ctx.args), None, None, None, None


def seq_to_heads(x, *, size: int, group, guard=None, purpose: str = "Ulysses all-to-all"):
    """``[B, H, L, D]`` (all heads, this rank's positions) -> ``[B, H/cp, cp*L, D]`` (its heads, every position)."""
    return x if size == 1 else _SeqToHeads.apply(x, size, group, guard, purpose)


def heads_to_seq(y, *, size: int, group, guard=None, purpose: str = "Ulysses all-to-all"):
    """The inverse of :func:`seq_to_heads`."""
    return y if size == 1 else _HeadsToSeq.apply(y, size, group, guard, purpose)


def dense_attention(spec: AttentionSpec, q, k, v, q_pos, keys: KeyBlock, q_docs=None, bias=None) -> torch.Tensor:
    """Attention of q ``[B, H, Lq, D]`` against every key of ``keys`` in fp32 (differentiable torch ops); a
    query that may meet no key gets 0. ``bias``: ``[B|1, H|1, Lq|1, seq]``, keys in global position order."""
    hkv = k.shape[1]
    qg = grouped(q, hkv)
    piece = bias_block(bias, slice(None), keys.pos, hkv)
    s, _ = block_scores(spec, qg, k, q_pos, keys.pos, piece)
    mask = visible(spec, q_pos, keys, q_docs, piece)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.detach().amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    total = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p / torch.where(total > 0, total, torch.ones_like(total)), v.float())
    return out.reshape(q.shape[:-1] + (v.shape[-1],)).to(q.dtype)


def _kv_heads(x, size, where):
    """k or v with heads a multiple of cp: as is, or each of fewer kv heads repeated to ``cp / Hkv`` ranks."""
    hkv = x.shape[1]
    if hkv % size == 0:
        return x
    if size % hkv == 0:
        return x.repeat_interleave(size // hkv, dim=1)
    raise PlanError(f"{hkv} kv heads neither divide by cp={size} nor divide it", where=where,
                    fix="use ring attention for this attention (cp_attention='ring'), or a cp that divides or is "
                        "divided by the kv heads")


def _bias_rows(bias, rank, size, group, guard, purpose):
    """This rank's heads of the bias for every query (layout order) and every key."""
    if bias is None:
        return None
    if bias.shape[2] > 1 and bias.shape[1] > 1:
        return seq_to_heads(bias, size=size, group=group, guard=guard, purpose=purpose + ": the bias")
    if bias.shape[2] > 1:
        if bias.dtype == torch.bool:
            return all_gather_dim(bias.to(torch.uint8), 2, group, guard, purpose).to(torch.bool)
        return _GatherRows.apply(bias, 2, group, guard, purpose + ": the bias rows")
    heads = bias.shape[1] // size
    return bias[:, rank * heads:(rank + 1) * heads] if bias.shape[1] > 1 else bias


def ulysses_attention(q, k, v, *, spec: AttentionSpec, layout: CpLayout, group, guard=None, bias=None, docs=None,
                      valid=None, purpose: str = "Ulysses attention") -> torch.Tensor:
    """Attention of this rank's shard by all-to-all: its heads over the whole sequence, then back."""
    size = layout.cp
    where = f"all-to-all attention over cp={size} (q {tuple(q.shape)}, k {tuple(k.shape)})"
    if q.shape[1] % size:
        raise PlanError(f"{q.shape[1]} query heads (per tp rank) do not divide by cp={size}", where=where,
                        fix="use ring attention (cp_attention='ring'), or a cp that divides the heads per tp rank")
    k, v = _kv_heads(k, size, where), _kv_heads(v, size, where)
    if size == 1:
        rank, k_pos = 0, layout.positions(0, device=q.device)
    else:
        rank, k_pos = dist.get_rank(group), layout.order(device=q.device)
    qh, kh, vh = (seq_to_heads(t, size=size, group=group, guard=guard, purpose=purpose) for t in (q, k, v))

    def gather(t):
        if t is None or size == 1:
            return t
        wire = t.to(torch.uint8) if t.dtype == torch.bool else t
        return all_gather_dim(wire, 1, group, guard, purpose).to(t.dtype)

    all_docs = gather(docs)
    keys = KeyBlock(pos=k_pos, docs=all_docs, valid=gather(valid))
    bias = _bias_rows(bias, rank, size, group, guard, purpose) if size > 1 else bias
    if spec.alibi_slopes is not None:  # this rank's heads' slopes
        heads = q.shape[1] // size
        spec = replace(spec, alibi_slopes=spec.alibi_slopes[rank * heads:(rank + 1) * heads])
    if size == 1:
        out = dense_attention(spec, qh, kh, vh, k_pos, keys, all_docs, bias)
    elif ulysses_plain(spec, qh, vh, bias, all_docs, keys.valid):
        out = _in_global_order(spec, qh, kh, vh, k_pos)
    else:  # blockwise (ring.py's kernel on one rank): keeps q, k, v, out and the log-sum-exp, never seq x seq
        out = blockwise_attention(qh, kh, vh, spec=spec, layout=WholeSequence(layout), bias=bias, docs=all_docs,
                                  valid=keys.valid, purpose=purpose)
    return heads_to_seq(out, size=size, group=group, guard=guard, purpose=purpose)


def ulysses_plain(spec: AttentionSpec, q, v, bias, docs, valid) -> bool:
    """Whether the attention has no rule beyond causal (no window, soft-cap, ALiBi, bias, documents or padding)
    and values of the queries' head size: one fused SDPA call over the whole sequence computes it."""
    return (spec.window is None and spec.softcap is None and spec.alibi_slopes is None and bias is None
            and docs is None and valid is None and v.shape[-1] == q.shape[-1])


def _in_global_order(spec: AttentionSpec, q, k, v, order: torch.Tensor) -> torch.Tensor:
    """One fused attention (SDPA) over the gathered sequence put back in global order, its output returned in
    layout order: a plain causal attention as one kernel call rather than a block per pair of runs (with the
    load-balanced layout the gathered runs are out of order; ``order``: each gathered token's global position)."""
    ahead = torch.argsort(order)  # (the gathered index of each global position)
    q, k, v = (t.index_select(2, ahead) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(  # (GQA: query head kv * G + g reads kv head kv)
        q, k, v, is_causal=spec.causal, scale=spec.scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.index_select(2, order)


class WholeSequence:
    """Every rank's shard of ``layout`` one after another, as a one-rank layout: the sequence Ulysses gathers
    (rank by rank, each shard in its own order), for ring.py's blockwise attention over it."""

    cp = 1

    def __init__(self, layout: CpLayout):
        self.layout, self.seq_len = layout, layout.seq_len
        self.local_len = layout.seq_len

    def runs(self, rank: int) -> tuple[tuple[int, int], ...]:
        return tuple(run for r in range(self.layout.cp) for run in self.layout.runs(r))

    def positions(self, rank: int, *, device=None) -> torch.Tensor:
        return self.layout.order(device=device)


class UlyssesAttention(GraphCollective):
    """All-to-all attention as a graph node: ``(q, k, v[, bias, docs, valid]) -> out``, over the mesh axis ``cp``."""

    kind = "all_to_all(forward and backward)"

    def __init__(self, *, axis: str, size: int, layout: CpLayout, spec: AttentionSpec, dropout: float = 0.0):
        super().__init__(axis=axis, size=size)
        if dropout:
            raise PlanError(f"attention dropout p={dropout} under context parallelism: the single-device dropout "
                            "mask cannot be reproduced on sequence shards", where="all-to-all attention",
                            fix="set the model's attention dropout to 0 (config.attention_dropout=0.0) for cp > 1")
        if layout.cp != size:
            raise PlanError(f"the layout is cut for cp={layout.cp}, the axis has {size} ranks",
                            where="all-to-all attention", fix="build the layout with the cp axis's size")
        self.layout, self.spec = layout, spec

    def forward(self, q, k, v, bias=None, docs=None, valid=None):
        group = self._require_group() if self.size > 1 else None
        return ulysses_attention(q, k, v, spec=self.spec, layout=self.layout, group=group, guard=self.guard,
                                 bias=bias, docs=docs, valid=valid, purpose=self.purpose)

    def meta_forward(self, q, k, v, *rest):
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))

    def meta_flops(self, q, k, v, *rest) -> int:
        """This rank's forward FLOPs (the shape propagation's counter does not see inside the op)."""
        return rank_flops(q, v, self.layout.seq_len)

    def comm(self, in_bytes: int, out_bytes: int) -> list[Comm]:
        """q, k, v and the output each cross one all-to-all forward and one backward (k, v counted as q's size)."""
        if self.size == 1:
            return []
        return [Comm("forward", "all_to_all", 3 * in_bytes + out_bytes),
                Comm("backward", "all_to_all", 3 * in_bytes + out_bytes)]

    def extra_repr(self) -> str:
        parts = [f"axis={self.axis!r}, size={self.size}, seq_len={self.layout.seq_len}",
                 f"load_balanced={self.layout.load_balanced}", f"causal={self.spec.causal}"]
        parts += [f"window={self.spec.window}"] if self.spec.window is not None else []
        parts += [f"softcap={self.spec.softcap}"] if self.spec.softcap is not None else []
        return ", ".join(parts)
