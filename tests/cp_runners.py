"""Runner kinds for context parallelism's attention ops (``kind="cp_runners:attention_cases"``).

One spawned group runs every case of :data:`CASES` through both strategies (ring and all-to-all) on
its ``cp = world`` ranks. The oracle is written here and shares no code with the ops: the whole
sequence on one device, eager attention (``q @ k^T``, scale, soft-capping, bias, a dense boolean mask,
softmax, ``@ v``) and ``F.scaled_dot_product_attention`` where it applies, both differentiated by
autograd. Every rank compares its shard of the output and of dq, dk, dv (and of a learned bias's
gradient) with the oracle's (fp32, relative 1e-5) and reports the worst error per case; a rank that
raised reports the error.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class AttnCase:
    """One attention to judge: shapes, mask rules, the layout, and which strategies take it."""

    name: str
    heads: int = 4
    kv_heads: int = 4
    seq: int = 32
    head_dim: int = 8
    v_dim: int = 8
    batch: int = 2
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    alibi: bool = False
    padding: bool = False  # key padding (the last tokens of row 0), as kv_valid
    docs: bool = False  # packed documents (document ids)
    dense: str = ""  # "bool": the mask as a dense boolean bias; "additive": transformers' lowest-value mask
    learned_bias: bool = False  # a random additive bias that requires grad
    bias_heads: bool = True  # the learned bias per head (else one for every head)
    load_balanced: bool = True
    strategies: tuple = ("ring", "ulysses")


CASES = [
    AttnCase("full"),
    AttnCase("full_contiguous", load_balanced=False),
    AttnCase("causal", causal=True),
    AttnCase("causal_contiguous", causal=True, load_balanced=False),
    AttnCase("causal_gqa", causal=True, kv_heads=2),
    AttnCase("causal_mqa", causal=True, kv_heads=1),
    AttnCase("window_short", causal=True, window=3),
    AttnCase("window_long", causal=True, window=11, kv_heads=2),
    AttnCase("padding", padding=True),
    AttnCase("padding_dense_bool", padding=True, dense="bool"),
    AttnCase("causal_padding_additive", causal=True, padding=True, dense="additive"),
    AttnCase("packed_docs", causal=True, docs=True),
    AttnCase("packed_docs_dense_bool", causal=True, docs=True, dense="bool"),
    AttnCase("alibi", causal=True, alibi=True),
    AttnCase("learned_bias", learned_bias=True),
    AttnCase("learned_shared_bias", learned_bias=True, bias_heads=False, causal=True, kv_heads=2),
    AttnCase("softcap_window", causal=True, softcap=5.0, window=9, kv_heads=2),
    AttnCase("latent_dims", causal=True, head_dim=12, v_dim=8),
]


def _layout(case, cp):
    from autopar.ops.context_parallel.layout import CpLayout
    return CpLayout(seq_len=case.seq, cp=cp, load_balanced=case.load_balanced)


def _slopes(heads: int) -> tuple[float, ...]:
    return tuple(2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads))


def _doc_ids(case) -> torch.Tensor:
    """Documents of lengths that cross the chunk boundaries (5, 9, 3, ... tokens)."""
    lengths, ids, doc = [5, 9, 3, 11, 7, 13], [], 0
    while len(ids) < case.seq:
        ids += [doc] * lengths[doc % len(lengths)]
        doc += 1
    row = torch.tensor(ids[:case.seq])
    return torch.stack([row, row.max() - row.flip(0)])  # the second row: the documents in reverse order


def inputs(case):
    """The whole-sequence tensors of ``case`` (the same on every rank: one seed)."""
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    b, s = case.batch, case.seq
    q = torch.randn(b, case.heads, s, case.head_dim, generator=g)
    k = torch.randn(b, case.kv_heads, s, case.head_dim, generator=g)
    v = torch.randn(b, case.kv_heads, s, case.v_dim, generator=g)
    dout = torch.randn(b, case.heads, s, case.v_dim, generator=g)
    valid = torch.ones(b, s, dtype=torch.bool)
    if case.padding:
        valid[0, s - 7:] = False
    docs = _doc_ids(case)[:b] if case.docs else None
    learned = torch.randn(1, case.heads if case.bias_heads else 1, s, s, generator=g) if case.learned_bias else None
    return dict(q=q, k=k, v=v, dout=dout, valid=valid, docs=docs, learned=learned)


def oracle_mask(case, t) -> torch.Tensor:
    """Boolean [B, 1, S, S]: which (query, key) pairs may meet, built from the definitions."""
    s = case.seq
    qi, ki = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    mask = torch.ones(s, s, dtype=torch.bool)
    if case.causal:
        mask &= ki <= qi
    if case.window is not None:
        mask &= qi - ki < case.window
    mask = mask.expand(case.batch, 1, s, s).clone()
    mask &= t["valid"][:, None, None, :]
    if t["docs"] is not None:
        mask &= t["docs"][:, None, :, None] == t["docs"][:, None, None, :]
    return mask


def oracle_bias(case, t) -> torch.Tensor | None:
    """The additive bias [1|B, H, S, S] of ALiBi or the learned one (None without)."""
    s = case.seq
    if case.alibi:
        slopes = torch.tensor(_slopes(case.heads)).view(1, -1, 1, 1)
        return slopes * torch.arange(s).view(1, 1, 1, s).float()  # Bloom writes slope * key position
    return t["learned"]


def eager_oracle(case, t, scale):
    """(out, dq, dk, dv, dlearned) of the whole sequence by eager attention, autograd for the gradients."""
    q, k, v = (t[n].clone().requires_grad_() for n in ("q", "k", "v"))
    learned = t["learned"].clone().requires_grad_() if t["learned"] is not None else None
    rep = case.heads // case.kv_heads
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ kk.transpose(-1, -2) * scale
    if case.softcap is not None:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    bias = learned if learned is not None else oracle_bias(case, t)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~oracle_mask(case, t), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vv
    out.backward(t["dout"])
    return out.detach(), q.grad, k.grad, v.grad, (learned.grad if learned is not None else None)


def sdpa_oracle(case, t, scale):
    """The output by ``F.scaled_dot_product_attention`` (no soft-capping), a second independent oracle."""
    rep = case.heads // case.kv_heads
    mask = torch.zeros(oracle_mask(case, t).shape).masked_fill(~oracle_mask(case, t), float("-inf"))
    bias = oracle_bias(case, t)
    mask = mask + (bias if bias is not None else 0)
    return F.scaled_dot_product_attention(t["q"], t["k"].repeat_interleave(rep, dim=1),
                                          t["v"].repeat_interleave(rep, dim=1), attn_mask=mask, scale=scale)


def local_inputs(case, t, layout, rank):
    """This rank's q, k, v, dout shards and what the op takes for the mask (bias rows, docs, valid)."""
    cut = {n: layout.shard(t[n], dim=2, rank=rank) for n in ("q", "k", "v", "dout")}
    extra = {}
    if case.dense:
        mask = oracle_mask(case, t)
        dense = mask if case.dense == "bool" else torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        extra["bias"] = layout.shard(dense, dim=2, rank=rank)
    else:
        if case.padding:
            extra["valid"] = layout.shard(t["valid"], dim=1, rank=rank)
        if case.docs:
            extra["docs"] = layout.shard(t["docs"], dim=1, rank=rank)
    if case.learned_bias:
        extra["bias"] = layout.shard(t["learned"], dim=2, rank=rank).clone().requires_grad_()
    return cut, extra


def run_one(case, strategy, group, cp, rank):
    """The op's output and gradients on this rank (its shards), and the oracle's shards to compare."""
    from autopar.ops.context_parallel.block_math import AttentionSpec
    from autopar.ops.context_parallel.ring import ring_attention
    from autopar.ops.context_parallel.ulysses import ulysses_attention
    t, layout = inputs(case), _layout(case, cp)
    scale = 1 / math.sqrt(case.head_dim)
    spec = AttentionSpec(scale=scale, causal=case.causal and not case.dense, window=None if case.dense else case.window,
                         softcap=case.softcap, alibi_slopes=_slopes(case.heads) if case.alibi else None)
    cut, extra = local_inputs(case, t, layout, rank)
    q, k, v = (cut[n].clone().requires_grad_() for n in ("q", "k", "v"))
    op = ring_attention if strategy == "ring" else ulysses_attention
    out = op(q, k, v, spec=spec, layout=layout, group=group, **extra)
    out.backward(cut["dout"])
    want = eager_oracle(case, t, scale)
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    expect = {name: layout.shard(w, dim=2, rank=rank) for name, w in zip(("out", "dq", "dk", "dv"), want[:4])}
    if case.learned_bias:
        got["dbias"] = extra["bias"].grad
        expect["dbias"] = layout.shard(want[4], dim=2, rank=rank)
    if not case.softcap:
        expect["sdpa_out"] = layout.shard(sdpa_oracle(case, t, scale), dim=2, rank=rank)
        got["sdpa_out"] = got["out"]
    return got, expect


def _compare(got: dict, expect: dict) -> str | None:
    for name, want in expect.items():
        try:
            torch.testing.assert_close(got[name], want, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            return f"{name}: {str(exc).splitlines()[1:4]}"
    return None


def attention_cases(case, mesh) -> dict:
    """Every :data:`CASES` entry through each strategy on this rank's cp = world group: {case/strategy: problem}."""
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    problems = {}
    for attn in CASES:
        for strategy in attn.strategies:
            got, expect = run_one(attn, strategy, group, cp, rank)
            problems[f"{attn.name}/{strategy}"] = _compare(got, expect)
    return {"problems": problems, "rank": rank}


def balance_cases(case, mesh) -> dict:
    """Sub-blocks each rank computes under a causal mask, load-balanced and contiguous (the ring's own count)."""
    from autopar.ops.context_parallel.block_math import AttentionSpec
    from autopar.ops.context_parallel.ring import ring_attention
    cp, rank, out = dist.get_world_size(), dist.get_rank(), {}
    for balanced in (True, False):
        attn = AttnCase("balance", causal=True, load_balanced=balanced)
        t, layout = inputs(attn), _layout(attn, cp)
        cut, _ = local_inputs(attn, t, layout, rank)
        counts: list = []
        ring_attention(cut["q"], cut["k"], cut["v"], spec=AttentionSpec(scale=0.3, causal=True), layout=layout,
                       group=dist.group.WORLD, counts=counts)
        gathered = [None] * cp
        dist.all_gather_object(gathered, len(counts))
        out[balanced] = gathered
    return {"blocks": out}
