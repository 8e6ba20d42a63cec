"""Ring attention over the cp ranks: K/V blocks passed around the ring, the softmax merged online.

Each cp rank holds its shard of q, k and v (``[B, H, L, D]``, ``L = seq / cp``, in the layout of
:class:`~autopar.ops.context_parallel.layout.CpLayout`). Forward, in ``cp`` steps::

    step 0           step 1           step 2           step 3          (cp = 4; Ki = rank i's K/V block)
    r0: q0 . K0      r0: q0 . K3      r0: q0 . K2      r0: q0 . K1
    r1: q1 . K1      r1: q1 . K0      r1: q1 . K3      r1: q1 . K2
    r2: q2 . K2      r2: q2 . K1      r2: q2 . K0      r2: q2 . K3
    r3: q3 . K3      r3: q3 . K2      r3: q3 . K1      r3: q3 . K0
          each step every rank sends the block it holds to rank + 1 and receives one from rank - 1
          (one ``batch_isend_irecv``, started before the step's compute so the two overlap)

Every block's output and log-sum-exp are merged into the running result in fp32
(:func:`~autopar.ops.context_parallel.block_math.merge`). Within a step each (query run, key run)
pair of the two shards is a sub-block, skipped when no pair in it may meet (a causal future, keys out
of the sliding window, no shared document, an all-masked piece of the dense mask); with the
load-balanced layout a rank's two chunks make the causal work equal on every rank.

Backward runs the ring again: K/V travel as in forward, and the gradients dK/dV of each block travel
with it, each rank adding its part, and go one step further at the end, back to the block's owner.
A step computes its part of the block it holds while the sum of the parts before it is still in
flight, and adds that sum when it arrives (both passes overlap the step's compute).
Only q, the local k and v, the output and the log-sum-exp are saved (no other rank's block).

The dense ``bias`` (boolean: True may meet; or additive) is this rank's query rows against every key
in *global* position order, ``[B|1, H|1, L|1, seq]``: each block reads the columns of its keys'
positions. ``docs`` and ``valid`` (``[B, L]``) are the local tokens' document ids and key padding;
they are all-gathered once (a few integers per token). Dropout is refused (the single-device mask
cannot be reproduced on shards).

Example (a world of one: the ring is this rank alone)::

    >>> from autopar.ops.context_parallel.block_math import AttentionSpec
    >>> from autopar.ops.context_parallel.layout import CpLayout
    >>> ring = RingAttention(axis="cp", size=1, layout=CpLayout(seq_len=8, cp=1),
    ...                      spec=AttentionSpec(scale=0.5, causal=True))
    >>> ring.extra_repr()
    "axis='cp', size=1, seq_len=8, load_balanced=True, causal=True"
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.ops.collectives import Comm, GraphCollective
from autopar.ops.context_parallel.block_math import (AttentionSpec, KeyBlock, bias_block, block_backward,
                                                          block_forward, grouped, merge, rank_flops)
from autopar.ops.context_parallel.layout import CpLayout

__all__ = ["RingAttention", "ring_attention", "blockwise_attention", "RingPass"]


class RingPass:
    """One step of the ring: send a tensor to rank + 1 and receive its peer's from rank - 1, asynchronously."""

    def __init__(self, tensor: torch.Tensor, *, group, guard, purpose: str):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.recv = torch.empty_like(tensor)
        self.group, self.guard, self.purpose = group, guard, purpose
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, (rank + 1) % size), group),
               dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % size), group)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            if self.guard is None:
                work.wait()
            else:
                self.guard.wait(work, op="ring send/recv", group=self.group, purpose=self.purpose)
        return self.recv


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, *likes: torch.Tensor) -> list[torch.Tensor]:
    out, at = [], 0
    for like in likes:
        out.append(flat[at:at + like.numel()].view(like.shape))
        at += like.numel()
    return out


def _gather_rows(x: torch.Tensor | None, group, size: int) -> list | None:
    """Every rank's ``[B, L]`` tensor (document ids, key padding), in rank order."""
    if x is None:
        return None
    if size == 1:
        return [x]
    pieces = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return pieces


class _Ctx:
    """What the forward and backward of one call share besides tensors."""

    def __init__(self, *, spec, layout, group, guard, purpose, counts=None):
        self.spec, self.layout, self.group, self.guard, self.purpose = spec, layout, group, guard, purpose
        self.counts = counts  # a list the forward appends (step, query run, key run) of each block it computes to
        self.size = layout.cp
        self.rank = dist.get_rank(group) if self.size > 1 else 0

    def runs(self, rank: int, device):
        """(local slice, global positions) of each run of ``rank``'s shard."""
        pos = self.layout.positions(rank, device=device)
        out, at = [], 0
        for _, length in self.layout.runs(rank):
            out.append((slice(at, at + length), pos[at:at + length]))
            at += length
        return out

    def pass_on(self, tensor: torch.Tensor, what: str) -> RingPass | None:
        if self.size == 1:
            return None
        return RingPass(tensor, group=self.group, guard=self.guard, purpose=f"{self.purpose}: {what}")


def _pairs(c: _Ctx, src: int, device, docs, valid):
    """Every (query run, key run) sub-block of this rank's queries against rank ``src``'s keys."""
    for qs, q_pos in c.runs(c.rank, device):
        for ks, k_pos in c.runs(src, device):
            keys = KeyBlock(pos=k_pos, docs=None if docs is None else docs[src][:, ks],
                            valid=None if valid is None else valid[src][:, ks])
            yield qs, q_pos, ks, keys


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, docs, valid, c: _Ctx):
        hkv = k.shape[1]
        qg = grouped(q, hkv)
        all_docs, all_valid = _gather_rows(docs, c.group, c.size), _gather_rows(valid, c.group, c.size)
        out = qg.new_zeros(qg.shape[:-1] + (v.shape[-1],), dtype=torch.float32)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        cur_k, cur_v = k, v
        for step in range(c.size):
            src = (c.rank - step) % c.size
            pending = c.pass_on(_pack(cur_k, cur_v), "K/V blocks") if step < c.size - 1 else None
            for qs, q_pos, ks, keys in _pairs(c, src, q.device, all_docs, all_valid):
                res = block_forward(c.spec, qg[..., qs, :], cur_k[:, :, ks], cur_v[:, :, ks], q_pos, keys,
                                    None if docs is None else docs[:, qs], bias_block(bias, qs, keys.pos, hkv))
                if res is not None:
                    out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], *res)
                    if c.counts is not None:
                        c.counts.append((step, qs.start, ks.start))
            if pending is not None:
                cur_k, cur_v = _unpack(pending.wait(), k, v)
        ctx.c, ctx.docs, ctx.valid = c, all_docs, all_valid
        ctx.bias_grad = bias is not None and bias.requires_grad
        result = out.reshape(q.shape[:-1] + (v.shape[-1],)).to(q.dtype)
        ctx.save_for_backward(q, k, v, bias, docs, result, lse)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, docs, out, lse = ctx.saved_tensors
        c, hkv = ctx.c, k.shape[1]
        qg, dg, og = grouped(q, hkv), grouped(dout, hkv), grouped(out, hkv)
        delta = (dg.float() * og.float()).sum(-1)
        dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=q.device) if ctx.bias_grad else None
        cur_k, cur_v = k, v
        arriving = None  # the dK/dV of the block this rank holds, summed by the ranks before it (in flight)
        for step in range(c.size):
            src = (c.rank - step) % c.size
            pending = c.pass_on(_pack(cur_k, cur_v), "K/V blocks (backward)") if step < c.size - 1 else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for qs, q_pos, ks, keys in _pairs(c, src, q.device, ctx.docs, ctx.valid):
                res = block_backward(c.spec, qg[..., qs, :], cur_k[:, :, ks], cur_v[:, :, ks], q_pos, keys,
                                     dg[..., qs, :], lse[..., qs], delta[..., qs],
                                     None if docs is None else docs[:, qs], bias_block(bias, qs, keys.pos, hkv),
                                     out=og[..., qs, :])
                if res is None:
                    continue
                dq[..., qs, :] += res[0]
                dk[:, :, ks] += res[1]
                dv[:, :, ks] += res[2]
                if dbias is not None:
                    _add_bias_grad(dbias, res[3], qs, keys.pos)
            if arriving is not None:  # (sent while this step computed: the pass overlaps the blocks)
                before_k, before_v = _unpack(arriving.wait(), dk, dv)
                dk += before_k
                dv += before_v
            arriving = c.pass_on(_pack(dk, dv), "dK/dV to their owners")  # on to the block's next holder
            if pending is not None:
                cur_k, cur_v = _unpack(pending.wait(), k, v)
        if arriving is not None:  # the last pass brings each block's gradient home
            dk, dv = _unpack(arriving.wait(), dk, dv)
        grads = (dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                 None if dbias is None else dbias.to(bias.dtype))
        return (*grads, None, None, None)


def _add_bias_grad(dbias: torch.Tensor, ds: torch.Tensor, qs: slice, cols: torch.Tensor) -> None:
    """Add a block's score gradient ``[B, Hkv, G, lq, lk]`` into the bias gradient's rows and key columns."""
    g = ds.reshape(ds.shape[0], -1, *ds.shape[3:])
    for d in range(3):
        if dbias.shape[d] == 1:
            g = g.sum(d, keepdim=True)
    rows = dbias[:, :, qs] if dbias.shape[2] > 1 else dbias
    rows.index_add_(3, cols, g)


def ring_attention(q, k, v, *, spec: AttentionSpec, layout: CpLayout, group, guard=None, bias=None, docs=None,
                   valid=None, purpose: str = "ring attention", counts: list | None = None) -> torch.Tensor:
    """Attention of this rank's query shard against every key, by passing K/V around the cp ring.

    ``counts``: a list to which the forward appends ``(step, query run start, key run start)`` of every
    block it computes (the blocks it skips are missing), for reading the ring's work.
    """
    _check(q, k, v, bias, layout)
    return _Ring.apply(q, k, v, bias, docs, valid, _Ctx(spec=spec, layout=layout, group=group, guard=guard,
                                                        purpose=purpose, counts=counts))


def blockwise_attention(q, k, v, *, spec: AttentionSpec, layout, bias=None, docs=None, valid=None,
                        purpose: str = "blockwise attention") -> torch.Tensor:
    """The ring's kernel on one rank: every (query run, key run) block of a one-rank ``layout`` (``cp == 1``;
    positions in any order, e.g. Ulysses' gathered sequence) with the online softmax, keeping q, k, v, the
    output and the log-sum-exp for backward (the blocks are recomputed there: nothing of size seq x seq)."""
    if layout.cp != 1:
        raise PlanError(f"blockwise attention runs a one-rank layout, got cp={layout.cp}", where=purpose,
                        fix="use ring_attention for a layout cut over several ranks")
    return _Ring.apply(q, k, v, bias, docs, valid, _Ctx(spec=spec, layout=layout, group=None, guard=None,
                                                        purpose=purpose))


def _check(q, k, v, bias, layout: CpLayout) -> None:
    where = f"ring attention over cp={layout.cp} (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != layout.local_len:
        raise PlanError(f"q, k and v must be [batch, heads, {layout.local_len} local positions, head_dim]",
                        where=where, fix="transpose the heads before the sequence, as SDPA takes them")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1] or k.shape[2] != q.shape[2]:
        raise PlanError("the query heads must be a multiple of the kv heads, k and v alike", where=where,
                        fix="pass k and v with the model's kv heads (grouped-query attention needs no repeat)")
    if bias is not None and (bias.dim() != 4 or bias.shape[-1] != layout.seq_len
                             or bias.shape[2] not in (1, layout.local_len) or bias.shape[1] not in (1, q.shape[1])):
        raise PlanError(f"the mask/bias of shape {tuple(bias.shape)} is not [B|1, H|1, {layout.local_len}|1, "
                        f"{layout.seq_len}] (this rank's query rows against every key, in global order)",
                        where=where, fix="build the mask for the rank's global query positions and every key")


class RingAttention(GraphCollective):
    """Ring attention as a graph node: ``(q, k, v[, bias, docs, valid]) -> out``, over the mesh axis ``cp``."""

    kind = "ring send/recv (forward and backward)"

    def __init__(self, *, axis: str, size: int, layout: CpLayout, spec: AttentionSpec, dropout: float = 0.0,
                 kv_bytes: int = 0):
        super().__init__(axis=axis, size=size)
        if dropout:
            raise PlanError(f"attention dropout p={dropout} under context parallelism: the single-device dropout "
                            "mask cannot be reproduced on sequence shards", where="ring attention",
                            fix="set the model's attention dropout to 0 (config.attention_dropout=0.0) for cp > 1")
        if layout.cp != size:
            raise PlanError(f"the layout is cut for cp={layout.cp}, the axis has {size} ranks", where="ring attention",
                            fix="build the layout with the cp axis's size")
        self.layout, self.spec, self.kv_bytes = layout, spec, kv_bytes

    def forward(self, q, k, v, bias=None, docs=None, valid=None):
        group = self._require_group() if self.size > 1 else None
        return ring_attention(q, k, v, spec=self.spec, layout=self.layout, group=group, guard=self.guard,
                              bias=bias, docs=docs, valid=valid, purpose=self.purpose)

    def meta_forward(self, q, k, v, *rest):
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))

    def meta_flops(self, q, k, v, *rest) -> int:
        """This rank's forward FLOPs (the shape propagation's counter does not see inside the op)."""
        return rank_flops(q, v, self.layout.seq_len)

    def comm(self, in_bytes: int, out_bytes: int) -> list[Comm]:
        """K/V sent ``cp - 1`` times forward; backward K/V ``cp - 1`` times and the fp32 dK/dV ``cp`` times."""
        hops = self.size - 1
        if not hops or not self.kv_bytes:
            return []
        return [Comm("forward", "send_recv", hops * self.kv_bytes), Comm("backward", "send_recv", hops * self.kv_bytes),
                Comm("backward", "send_recv", self.size * self.kv_bytes)]

    def extra_repr(self) -> str:
        parts = [f"axis={self.axis!r}, size={self.size}, seq_len={self.layout.seq_len}",
                 f"load_balanced={self.layout.load_balanced}", f"causal={self.spec.causal}"]
        parts += [f"window={self.spec.window}"] if self.spec.window is not None else []
        parts += [f"softcap={self.spec.softcap}"] if self.spec.softcap is not None else []
        return ", ".join(parts)
