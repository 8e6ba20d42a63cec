"""Sum, over the tp group, the gradients of replicated parameters read on sequence shards.

Under sequence parallelism a LayerNorm weight (or a row-linear bias added after the
reduce-scatter) is replicated but only sees this rank's tokens, so each rank's gradient is a
partial sum. Once per step, after backward, the gradients of exactly those parameters
(:attr:`autopar.lowering.Lowered.tp_partial_grads`) are all-reduced over tp in one flat buffer,
as Megatron-LM does for its ``sequence_parallel`` parameters. Other replicated parameters need
nothing: Megatron's f/g already make their gradients equal on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ops.collectives import issue

__all__ = ["sum_partial_gradients"]


def sum_partial_gradients(params: list[torch.nn.Parameter], *, group, guard=None) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group``; missing gradients count as zero."""
    if not params or group is None:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    issue("all_reduce", dist.all_reduce, flat, group=group, guard=guard,
          purpose="the sequence-parallel partial gradients (tp)")
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
