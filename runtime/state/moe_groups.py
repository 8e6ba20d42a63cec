"""Expert parallelism's expert gradients and the full expert tensors.

The ``ep`` ranks of an expert-parallel group are carved out of the dp axis, and the dp ranks that hold
the same experts (``dp / ep`` of them) form the expert-data-parallel group ``edp``: both are axes of
:class:`autopar.parallel_dims.ParallelDims` (which dp indices form each group), and their process groups
are dims of the job's one DeviceMesh (:func:`autopar.parallel_dims.mesh_groups`).

Gradients: an expert's gradient on its rank already sums the contributions of every token the ep
group routed to it (the combine's backward brings them back). So the expert gradient is summed over
``edp`` and divided by dp, which is the mean over dp of one device's per-rank gradients, the value DDP
gives every other parameter. With context parallelism (cp > 1) a rank's ep group exchanges the tokens of
its own cp shard (ep is carved out of dp, at one cp coordinate), so the ranks holding the same experts and
other tokens are ``edcp = edp x cp``: the sum runs over them and is divided by dp x cp, as DDP divides
every other gradient there (``ParallelDims`` says why; edcp is edp when cp = 1). Under ZeRO-1/2 each
expert tensor is owned by one edcp rank (:class:`autopar.runtime.state.zero.ShardedOptimizer`); ZeRO-2
reduces its gradient to that owner only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ops.collectives import issue

__all__ = ["sync_expert_gradients", "full_expert_parameters"]


def sync_expert_gradients(params: list[torch.nn.Parameter], *, group, size: int, dp: int, guard=None,
                          owners: list[int] | None = None, rank: int | None = None) -> None:
    """Sum the expert gradients over the ``size`` ranks of ``group`` (edcp: edp x cp) and divide by ``dp``
    (the count DDP divides every other gradient by: dp x cp).

    ``owners`` (ZeRO-2, the experts partitioned over edcp): each gradient's owner's global rank; the sum is
    reduced to that owner only, and the other ranks drop their gradient (this rank is ``rank``)."""
    for i, p in enumerate(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if size > 1 and owners is not None:
            issue("reduce", dist.reduce, p.grad, owners[i], group=group, guard=guard,
                  purpose="the expert gradients to their owner among the ranks holding the same experts")
            if owners[i] != rank:
                p.grad = None
                continue
        elif size > 1:
            issue("all_reduce", dist.all_reduce, p.grad, group=group, guard=guard,
                  purpose="the expert gradients over the ranks holding the same experts")
        p.grad.div_(dp)


def full_expert_parameters(named: list, *, experts: tuple[str, ...], group, guard=None) -> list:
    """``named`` with every expert tensor replaced by all ep ranks' experts (concatenated on dim 0)."""
    wanted = set(experts)
    out = []
    for name, p in named:
        if name in wanted:
            local = p.detach().contiguous()
            size = dist.get_world_size(group)
            buf = local.new_empty((size * local.shape[0],) + tuple(local.shape[1:]))
            issue("all_gather", dist.all_gather_single, buf, local, group=group, guard=guard,
                  purpose="the expert tensors for the full state dict")
            p = buf
        out.append((name, p))
    return out

