"""Gradient synchronisation after a step's backward passes.

- Parameters that live on several pipeline stages (a tied embedding and LM head) have their
  gradients summed across the ranks holding them, by a p2p exchange inside the pp group.
- Data parallelism: gradients are averaged over the dp group in flat buckets (all-reduce).
Tensor-parallel replicated parameters need nothing: Megatron's f/g make their gradients equal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["sum_shared_gradients", "average_gradients", "flat_buckets"]

_BUCKET_BYTES = 25 * 1024 * 1024


def flat_buckets(tensors: list[torch.Tensor], *, bucket_bytes: int = _BUCKET_BYTES):
    """Group tensors of one dtype into buckets of about ``bucket_bytes``, in order."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() * t.element_size() > bucket_bytes or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def average_gradients(params: list[torch.nn.Parameter], *, group, size: int) -> None:
    """All-reduce and average ``params``' gradients over ``group`` (missing grads count as zero)."""
    if size == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for bucket in flat_buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_shared_gradients(shared: list[tuple[torch.nn.Parameter, list[int]]], *, rank: int,
                         group) -> None:
    """For each (param, peer global ranks holding a copy): grad += the peers' grads."""
    for param, peers in shared:
        others = [r for r in peers if r != rank]
        if not others:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        mine = param.grad.detach().clone()
        buffers = [torch.empty_like(mine) for _ in others]
        ops = [dist.P2POp(dist.isend, mine, r, group=group) for r in others]
        ops += [dist.P2POp(dist.irecv, b, r, group=group) for b, r in zip(buffers, others)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        # sum in global-rank order so every copy gets bitwise the same value
        contributions = sorted([(rank, mine)] + list(zip(others, buffers)), key=lambda x: x[0])
        total = contributions[0][1].clone()
        for _, g in contributions[1:]:
            total.add_(g)
        param.grad.copy_(total)
