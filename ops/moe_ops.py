"""Expert parallelism's token exchange: all-to-all dispatch and combine as differentiable graph modules.

An MoE layer's experts are split over the ``ep`` ranks of an expert-parallel group (rank ``j`` holds
experts ``[j*L, (j+1)*L)``, ``L = E / ep``). Each (token, choice) row goes to the rank holding its
expert and comes back, as Megatron-LM's ``MoEAlltoAllTokenDispatcher`` and torchtitan's expert
parallelism move them: sort the rows by expert, exchange the per-expert counts (one all-to-all of E
integers), then the rows themselves (an all-to-all with variable splits), and order what arrived by
local expert. By default nothing is dropped: every row is computed by its expert, so the result equals one
device. With a capacity factor ``cf`` each expert takes at most ``ceil(cf * rows / E)`` rows from each rank (the
first ones in row order, as Switch Transformer's expert capacity); the others are dropped (their output is
zero, the residual carries the token) and counted (:func:`dropped_rows`).

- :class:`MoeDispatch` ``(rows [S, ...], ids [S]) -> (local rows [R, ...], local ids [R], local offsets
  [L] int32, routing)``: local ids count from this rank's first expert, the offsets are the grouped
  matmul's cumulative row counts, ``routing`` (int64) is what combine needs to send rows back.
  Backward: the conjugate all-to-all, the gradient rows back to their tokens' ranks.
- :class:`MoeCombine` ``(local outputs [R, ...], routing) -> outputs [S, ...]`` in the dispatch's
  input order. Backward: the conjugate all-to-all, the gradient rows to the experts' ranks.

Unbound (a graph from ``autopar.plan``), they raise; ``meta_forward`` answers shapes for shape
propagation as if the rows stayed where they are (R = S: the balanced case).

Example (a world of one: the exchange is the identity)::

    >>> d = MoeDispatch(axis="ep", size=1, num_experts=4)
    >>> d.extra_repr()
    "axis='ep', size=1, num_experts=4"
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.ops.collectives import Comm, GraphCollective, issue

__all__ = ["MoeDispatch", "MoeCombine", "DpMean", "all_to_all_rows", "moe_exchange_nodes", "dropped_rows"]


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group, guard, purpose: str):
    """Rows ``[sum(send), ...]`` out in blocks of ``send`` to each rank; ``[sum(recv), ...]`` in."""
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    issue("all_to_all", dist.all_to_all_single, out, rows, output_split_sizes=recv, input_split_sizes=send,
          group=group, guard=guard, purpose=purpose)
    return out


def _pack(send: list[int], recv: list[int], total: int, kept: torch.Tensor, local_order: torch.Tensor) -> torch.Tensor:
    head = torch.tensor(send + recv + [total], dtype=torch.int64, device=kept.device)
    return torch.cat([head, kept.to(torch.int64), local_order.to(torch.int64)])


def _unpack(routing: torch.Tensor, size: int):
    head = routing[:2 * size + 1].tolist()
    send, recv, total = head[:size], head[size:2 * size], head[2 * size]
    kept = routing[2 * size + 1:2 * size + 1 + sum(send)]
    local_order = routing[2 * size + 1 + sum(send):]
    return send, recv, total, kept, local_order


def _scatter_rows(rows: torch.Tensor, index: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``out[index] = rows`` into ``total`` rows (zeros where nothing lands: dropped rows)."""
    out = rows.new_zeros(((rows.shape[0] if total is None else total),) + tuple(rows.shape[1:]))
    out[index] = rows
    return out


def _keep(ids: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int | None):
    """(rows kept, in expert order; the counts sent): the first ``capacity`` rows of each expert, in row order."""
    if capacity is None:
        return order, counts
    starts = torch.cumsum(counts, dim=0) - counts
    place = torch.arange(order.numel(), device=ids.device) - starts[ids[order]]
    return order[place < capacity], counts.clamp(max=capacity)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, ids, num_experts, capacity, group, guard, purpose):
        size = dist.get_world_size(group)
        local = num_experts // size
        order = torch.argsort(ids, stable=True)
        kept, counts = _keep(ids, order, torch.bincount(ids, minlength=num_experts).to(torch.int64), capacity)
        got = torch.empty_like(counts)  # got[src * local + e]: rows rank src sends to my expert e
        issue("all_to_all", dist.all_to_all_single, got, counts, group=group, guard=guard,
              purpose=f"the per-expert row counts of {purpose}")
        send = counts.view(size, local).sum(dim=1).tolist()
        recv = got.view(size, local).sum(dim=1).tolist()
        arrived = all_to_all_rows(rows[kept], send, recv, group, guard, purpose)
        local_ids = torch.repeat_interleave(torch.arange(local, device=ids.device).repeat(size), got)
        local_order = torch.argsort(local_ids, stable=True)
        offsets = torch.cumsum(got.view(size, local).sum(dim=0), dim=0).to(torch.int32)
        ctx.group, ctx.guard, ctx.purpose = group, guard, purpose
        ctx.send, ctx.recv, ctx.total = send, recv, rows.shape[0]
        ctx.save_for_backward(kept, local_order)
        routing = _pack(send, recv, rows.shape[0], kept, local_order)
        out_ids = local_ids[local_order]
        ctx.mark_non_differentiable(out_ids, offsets, routing)
        return arrived[local_order], out_ids, offsets, routing

    @staticmethod
    def backward(ctx, grad, *_):
        kept, local_order = ctx.saved_tensors
        back = all_to_all_rows(_scatter_rows(grad, local_order), ctx.recv, ctx.send, ctx.group, ctx.guard,
                               f"the backward of {ctx.purpose}")
        return _scatter_rows(back, kept, ctx.total), None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, routing, group, guard, purpose):
        size = dist.get_world_size(group)
        send, recv, total, kept, local_order = _unpack(routing, size)
        home = all_to_all_rows(_scatter_rows(rows, local_order), recv, send, group, guard, purpose)
        ctx.group, ctx.guard, ctx.purpose, ctx.send, ctx.recv = group, guard, purpose, send, recv
        ctx.save_for_backward(kept, local_order)
        return _scatter_rows(home, kept, total)  # a dropped row's output is zero

    @staticmethod
    def backward(ctx, grad):
        kept, local_order = ctx.saved_tensors
        away = all_to_all_rows(grad[kept], ctx.send, ctx.recv, ctx.group, ctx.guard, f"the backward of {ctx.purpose}")
        return away[local_order], None, None, None, None


class MoeDispatch(GraphCollective):
    """Rows to their experts' ranks (all-to-all forward; its conjugate backward), sorted by local expert."""

    kind = "all_to_all(forward)+all_to_all(backward)"

    def __init__(self, *, axis: str, size: int, num_experts: int, capacity_factor: float | None = None):
        super().__init__(axis=axis, size=size)
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.rows_seen = self.rows_dropped = 0  # counted over every call since the last reset

    def capacity(self, num_rows: int) -> int | None:
        """Rows each expert takes from one rank: ``ceil(capacity_factor * rows / experts)`` (None: all)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_rows / self.num_experts))

    def forward(self, rows, ids):
        out = _Dispatch.apply(rows, ids.to(torch.int64), self.num_experts, self.capacity(rows.shape[0]),
                              self._require_group(), self.guard, self.purpose)
        if self.capacity_factor is not None:
            sent = int(out[3][:self.size].sum())
            self.rows_seen += rows.shape[0]
            self.rows_dropped += rows.shape[0] - sent
        return out

    def meta_forward(self, rows, ids):
        local = self.num_experts // self.size
        routing = ids.new_empty((2 * self.size + 1 + 2 * ids.shape[0],), dtype=torch.int64)
        return (torch.empty_like(rows), ids.new_empty(ids.shape, dtype=torch.int64),
                ids.new_empty((local,), dtype=torch.int32), routing)

    def comm(self, in_bytes, out_bytes):
        return [Comm("forward", "all_to_all", in_bytes), Comm("backward", "all_to_all", in_bytes)]

    def extra_repr(self) -> str:
        cf = f", capacity_factor={self.capacity_factor}" if self.capacity_factor is not None else ""
        return f"axis={self.axis!r}, size={self.size}, num_experts={self.num_experts}{cf}"


class MoeCombine(GraphCollective):
    """Expert outputs back to their tokens' ranks, in the dispatch's input order (and the conjugate backward)."""

    kind = "all_to_all(forward)+all_to_all(backward)"

    def forward(self, rows, routing):
        return _Combine.apply(rows, routing, self._require_group(), self.guard, self.purpose)

    def meta_forward(self, rows, routing):
        return torch.empty_like(rows)

    def comm(self, in_bytes, out_bytes):
        return [Comm("forward", "all_to_all", out_bytes), Comm("backward", "all_to_all", out_bytes)]


def dropped_rows(graphs) -> tuple[int, int]:
    """(rows dropped, rows routed) by the capacity factor in ``graphs``' dispatch nodes since the last call; resets."""
    dropped = seen = 0
    for gm in graphs:
        for module in gm.modules():
            if isinstance(module, MoeDispatch):
                dropped, seen = dropped + module.rows_dropped, seen + module.rows_seen
                module.rows_seen = module.rows_dropped = 0
    return dropped, seen


def moe_exchange_nodes(gm) -> list:
    """The dispatch and combine nodes of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), (MoeDispatch, MoeCombine))]


class _MeanForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, guard, purpose):
        out = x.contiguous().clone()
        issue("all_reduce", dist.all_reduce, out, group=group, guard=guard, purpose=purpose)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class DpMean(GraphCollective):
    """A batch statistic averaged over dp (all-reduce forward); backward the identity.

    Every dp rank then computes the same global statistic, and each rank's gradient into its own
    share is the full one, which DDP's mean over dp turns into one device's gradient.
    """

    kind = "all_reduce(forward)"

    def forward(self, x):
        return _MeanForward.apply(x, self._require_group(), self.guard, self.purpose)

    def comm(self, in_bytes, out_bytes):
        return [Comm("forward", "all_reduce", out_bytes)]
