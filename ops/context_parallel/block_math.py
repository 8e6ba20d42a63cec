"""The arithmetic of attention on one block of queries against one block of keys, in fp32.

Both context-parallel strategies compute attention on pieces of the sequence and need the same
rules: which (query, key) pairs may meet (:func:`visible`), the scores of a block with scale,
soft-capping and additive bias (:func:`block_scores`), the online-softmax merge of a block into the
running result (:func:`merge`, in log-sum-exp form), and the gradients of a block given the final
log-sum-exp (:func:`block_backward`). Every query and key carries its *global* position, so the
rules hold whatever order the pieces come in (the load-balanced layout, an all-to-all's layout order).

A pair may meet when: the key is not after the query (``causal``), the key is fewer than ``window``
positions behind it (``window``: transformers' sliding window, ``q - k < window``), both are in the
same document (``docs``, packed sequences), the key is not padding (``kv_valid``), and the dense mask
allows it (a boolean ``bias`` True, or an additive ``bias`` above half the dtype's lowest value:
transformers writes masked entries as that lowest value, which ``exp`` turns into an exact 0).

Scores: ``s = scale * q . k``; with ``softcap`` ``s = softcap * tanh(s / softcap)`` (Gemma 2), then
plus the finite part of ``bias`` and ALiBi's ``slope_h * (k - q)``. A query that may meet no key
gets the output 0 and log-sum-exp ``-inf`` (flash attention's convention; an eager model with an
additive lowest-value mask averages every key there instead: such rows differ, and a model's loss
never reads them, as they are padding).

Grouped-query attention: q ``[B, Hkv, G, Lq, D]``, k and v ``[B, Hkv, Lk, D]``; multi-head is ``G = 1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionSpec", "KeyBlock", "visible", "block_scores", "merge", "block_forward", "block_backward",
           "grouped", "bias_block", "fused_case", "rank_flops"]


@dataclass(frozen=True)
class AttentionSpec:
    """What an attention computes besides q, k and v: its mask rules, scale, soft-capping and ALiBi slopes."""

    scale: float
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None  # one per query head


def rank_flops(q: torch.Tensor, v: torch.Tensor, seq_len: int) -> int:
    """Forward FLOPs of one cp rank's share of an attention: its queries (``q`` ``[B, H, Lq, D]``) against every key
    of the sequence (``seq_len``), QK^T and PV, as the lowering costs SDPA (passes/frontend/annotate.py): the
    ring and the all-to-all both do 1/cp of the whole attention's work on each rank (masks not discounted)."""
    b, h, lq, d = q.shape
    return 2 * b * h * lq * seq_len * (d + v.shape[-1])


@dataclass(frozen=True)
class KeyBlock:
    """One block of keys: its global positions and, per batch row, document ids and padding (or None)."""

    pos: torch.Tensor  # (Lk,) int64
    docs: torch.Tensor | None = None  # (B, Lk)
    valid: torch.Tensor | None = None  # (B, Lk) bool


def grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B, Hkv, H / Hkv, L, D]`` (query heads grouped by their kv head)."""
    b, h, length, d = q.shape
    return q.reshape(b, num_kv_heads, h // num_kv_heads, length, d)


def bias_block(bias: torch.Tensor | None, rows: slice, cols: torch.Tensor, num_kv_heads: int):
    """The piece of a ``[B|1, H|1, Lq|1, S]`` bias for query rows ``rows`` and key positions ``cols``,
    shaped to broadcast against grouped scores ``[B, Hkv, G, lq, lk]``."""
    if bias is None:
        return None
    piece = bias[:, :, rows if bias.shape[2] > 1 else slice(None)].index_select(3, cols)
    if piece.shape[1] > 1:
        return piece.reshape(piece.shape[0], num_kv_heads, piece.shape[1] // num_kv_heads, *piece.shape[2:])
    return piece.unsqueeze(1)


def visible(spec: AttentionSpec, q_pos: torch.Tensor, keys: KeyBlock, q_docs=None, bias=None) -> torch.Tensor | None:
    """Boolean ``[B|1, 1|Hkv, 1|G, lq, lk]`` of the pairs that may meet; None when every pair may."""
    mask = None

    def both(extra):
        return extra if mask is None else mask & extra

    diff = q_pos.view(-1, 1) - keys.pos.view(1, -1)  # q - k
    if spec.causal:
        mask = both(diff >= 0)
    if spec.window is not None:
        mask = both(diff < spec.window)
    if mask is not None:
        mask = mask.view(1, 1, 1, *mask.shape)
    if keys.docs is not None:
        mask = both((q_docs.unsqueeze(-1) == keys.docs.unsqueeze(-2))[:, None, None])
    if keys.valid is not None:
        mask = both(keys.valid[:, None, None, None, :])
    if bias is not None:
        mask = both(bias if bias.dtype == torch.bool else bias > torch.finfo(bias.dtype).min / 2)
    return mask


def block_scores(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, q_pos, k_pos, bias=None):
    """(scores after soft-capping and bias, tanh of the capped scores or None) of grouped q against k, fp32."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q.float(), k.float()) * spec.scale
    t = None
    if spec.softcap is not None:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    if bias is not None and bias.dtype != torch.bool:
        low = torch.finfo(bias.dtype).min / 2
        s = s + torch.where(bias > low, bias, torch.zeros((), dtype=bias.dtype, device=bias.device)).float()
    if spec.alibi_slopes is not None:
        hkv = q.shape[1]
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=q.device).view(1, hkv, -1, 1, 1)
        s = s + slopes * (k_pos.view(1, -1) - q_pos.view(-1, 1)).float()
    return s, t


def fused_case(spec: AttentionSpec, q, q_pos: torch.Tensor, keys: KeyBlock, q_docs=None, bias=None,
               v_dim: int | None = None) -> str | None:
    """How a block runs on the CPU's fused attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``):
    ``"full"`` (every pair meets), ``"causal"`` (the queries and keys are the same run of positions: the kernel's
    own causal mask), ``"skip"`` (causal, every key after every query), or None: the plain fp32 path, for any
    mask or score rule the kernel does not take (windows, documents, padding, bias, soft-capping, ALiBi), values
    of another head size than the queries' (``v_dim``: MLA) and off the CPU."""
    if (q.device.type != "cpu" or (v_dim is not None and v_dim != q.shape[-1]) or spec.window is not None or spec.softcap is not None or spec.alibi_slopes is not None
            or bias is not None or q_docs is not None or keys.docs is not None or keys.valid is not None):
        return None
    if not spec.causal:
        return "full"
    q_lo, q_hi, k_lo, k_hi = int(q_pos[0]), int(q_pos[-1]), int(keys.pos[0]), int(keys.pos[-1])
    if q_hi - q_lo != len(q_pos) - 1 or k_hi - k_lo != len(keys.pos) - 1:  # (runs: ascending, contiguous)
        return None
    if q_hi < k_lo:
        return "skip"
    if q_lo > k_hi:
        return "full"
    return "causal" if (q_lo, q_hi) == (k_lo, k_hi) else None


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """k or v ``[B, Hkv, L, D]`` repeated to the query heads ``[B, Hkv * G, L, D]`` (head ``kv * G + g``)."""
    return x.float().repeat_interleave(groups, dim=1) if groups > 1 else x.float()


def _fused_forward(spec, q, k, v, causal: bool):
    b, hkv, g, lq, d = q.shape
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float().reshape(b, hkv * g, lq, d), _heads(k, g), _heads(v, g), 0.0, causal, scale=spec.scale)[:2]
    return out.reshape(b, hkv, g, lq, v.shape[-1]), lse.reshape(b, hkv, g, lq)


def _fused_backward(spec, q, k, v, dout, out, lse, causal: bool):
    b, hkv, g, lq, d = q.shape
    flat = (b, hkv * g, lq)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.float().reshape(*flat, -1), q.float().reshape(*flat, d), _heads(k, g), _heads(v, g),
        out.float().reshape(*flat, -1), lse.reshape(flat), 0.0, causal, scale=spec.scale)
    lk = k.shape[2]
    return (dq.reshape(b, hkv, g, lq, d), dk.reshape(b, hkv, g, lk, d).sum(2),
            dv.reshape(b, hkv, g, lk, v.shape[-1]).sum(2), None)


def block_forward(spec, q, k, v, q_pos, keys: KeyBlock, q_docs=None, bias=None):
    """(normalised output fp32 ``[B, Hkv, G, lq, Dv]``, log-sum-exp ``[B, Hkv, G, lq]``) of one block, or
    None when no pair of it may meet (the block is skipped)."""
    case = fused_case(spec, q, q_pos, keys, q_docs, bias, v_dim=v.shape[-1])
    if case == "skip":
        return None
    if case is not None:
        return _fused_forward(spec, q, k, v, case == "causal")
    mask = visible(spec, q_pos, keys, q_docs, bias)
    if mask is not None and not bool(mask.any()):
        return None
    s, _ = block_scores(spec, q, k, q_pos, keys.pos, bias)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.float()) / torch.where(total > 0, total, torch.ones_like(total))
    return out, (m + torch.log(total)).squeeze(-1)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The softmax over the union of two key sets from each one's normalised output and log-sum-exp."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * a + block_out * b, new


def block_backward(spec, q, k, v, q_pos, keys: KeyBlock, dout, lse, delta, q_docs=None, bias=None, out=None):
    """(dq, dk, dv, dbias) of one block in fp32 given the final ``lse`` and ``delta = rowsum(dout * out)``,
    or None when the block is skipped. ``dbias`` is the scores' gradient ``[B, Hkv, G, lq, lk]`` (None on the
    fused kernel, which takes no bias). ``out``: the final output of these queries, which the fused kernel
    reads (its rows' ``delta``); without it the block takes the plain path."""
    case = fused_case(spec, q, q_pos, keys, q_docs, bias, v_dim=v.shape[-1])
    if case == "skip":
        return None
    if case is not None and out is not None:
        return _fused_backward(spec, q, k, v, dout, out, lse, case == "causal")
    mask = visible(spec, q_pos, keys, q_docs, bias)
    if mask is not None and not bool(mask.any()):
        return None
    s, t = block_scores(spec, q, k, q_pos, keys.pos, bias)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    p = torch.exp(s - safe)
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros_like(p))
    dout = dout.float()
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout, v.float())
    ds = p * (dp - delta.unsqueeze(-1))
    dbias = ds
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.float()) * spec.scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.float()) * spec.scale
    return dq, dk, dv, dbias
