"""Gradient synchronisation of a training step: over dp while backward runs, across stages after it.

:class:`GradientSync` is what the program calls: ``begin`` before the schedule runs, ``finish``
after it, before the optimizer steps.

- Data parallelism (DDP, ZeRO-1/2): gradients are reduced over the dp group in buckets *while
  backward runs* (:class:`autopar.runtime.state.ddp_buckets.GradBuckets`): all-reduced (DDP) or reduced
  to the parameter's owner (ZeRO-1/2). ZeRO-3 reduce-scatters inside the graph's backward
  (:mod:`autopar.passes.data_parallel.zero3`), so nothing is left to do here.
- Mixture-of-experts experts split over ep: summed over the ranks holding the same experts and other
  tokens (``edcp`` = edp x cp; edp without context parallelism) and divided by dp x cp after backward
  (:func:`autopar.runtime.state.moe_groups.sync_expert_gradients`; under ZeRO-2 with the experts owned
  over edcp, reduced to their owner), under ZeRO-3 too where it leaves them whole (edcp = 1); those
  ZeRO-3 shards over edcp reduce-scatter in the graph like every other shard.
- Parameters that live on several pipeline stages (a tied embedding and LM head) first have
  their gradients summed across the ranks holding them, by a p2p exchange inside the pp group,
  so they are left out of the overlapped buckets and reduced over dp after that exchange.
Tensor-parallel replicated parameters need nothing: Megatron's f/g make their gradients equal.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from autopar.ir.graph_names import user_name
from autopar.ops.collectives import issue
from autopar.ops.comm_guard import CommGuard
from autopar.ops.zero3_ops import zero3_targets
from autopar.runtime.state.ddp_buckets import GradBuckets
from autopar.runtime.state.moe_groups import sync_expert_gradients
from autopar.runtime.execution.rank_context import RankContext

__all__ = ["GradientSync", "sum_shared_gradients", "average_gradients", "flat_buckets"]

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


def average_gradients(params: list[torch.nn.Parameter], *, group, size: int, guard: CommGuard | None = None) -> None:
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
        issue("all_reduce", dist.all_reduce, flat, group=group, guard=guard, purpose="the gradients' dp average")
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_shared_gradients(shared: list[tuple[torch.nn.Parameter, list[int]]], *, rank: int,
                         group, guard: CommGuard | None = None) -> None:
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
        purpose = "the gradient of a weight tied across stages"
        entry = None if guard is None else guard.record("send/recv", purpose, peers)
        for work in dist.batch_isend_irecv(ops):
            if guard is None:
                work.wait()
            else:
                guard.wait(work, op=f"send/recv with ranks {others}", group=group, purpose=purpose, entry=entry)
        # sum in global-rank order so every copy gets bitwise the same value
        contributions = sorted([(rank, mine)] + list(zip(others, buffers)), key=lambda x: x[0])
        total = contributions[0][1].clone()
        for _, g in contributions[1:]:
            total.add_(g)
        param.grad.copy_(total)


class GradientSync:
    """This rank's gradient synchronisation, as the plan's data-parallel mode and ZeRO stage ask."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *, ctx: RankContext, shared: list,
                 plan, owners: dict[str, int] | None, uses: dict[str, int],
                 current_action: Callable[[], str] = lambda: "", zero3_runtimes: tuple = (),
                 expert_owners: dict[str, int] | None = None):
        """``expert_owners``: {expert name: owning edcp index} when ZeRO-1/2 partition the experts over edcp."""
        self.shared, self.info, self.guard = shared, ctx.info, ctx.guard
        self.zero3_runtimes = zero3_runtimes
        self._t0 = time.perf_counter()
        mode = getattr(plan, "data_parallel", "ddp")
        # weights' gradients are summed over dp x cp (cp ranks hold other positions of the same rows)
        self.active = plan.dims.dcp > 1 and mode == "ddp" and plan.zero_stage != 3
        self.buckets = self.post = None
        named_params = [(n, p) for n, p in named_params if p.requires_grad]  # frozen weights need no sync
        experts = set(getattr(plan, "expert_params", ()))  # MoE experts: over edcp (runtime/state/moe_groups.py)
        in_graph = {user_name(t) for r in zero3_runtimes for t in zero3_targets(r.gm)}  # ZeRO-3's reduce-scatters
        expert_named = [(n, p) for n, p in named_params if n in experts and n not in in_graph] \
            if plan.mesh.dp > 1 and mode == "ddp" else []
        self.experts = [p for _, p in expert_named]
        self.expert_dst = None  # ZeRO-2: each expert's gradient reduced to its edcp owner (global rank)
        self.expert_axis = ctx.axis("edcp")  # the ranks holding my experts and other tokens (edp x cp)
        self.dcp = plan.dims.dcp  # the expert gradients' sum is divided by it, as DDP divides every other one
        if expert_owners is not None and plan.zero_stage == 2 and expert_named:
            self.expert_dst = [self.expert_axis.ranks[expert_owners[n]] for n, _ in expert_named]
        if not self.active:
            return
        shared_ids = {id(p) for p, _ in shared}
        named_params = [(n, p) for n, p in named_params if n not in experts]
        common = dict(dp=ctx.axis("dcp"), bucket_bytes=int(getattr(plan, "bucket_mb", 25.0) * 2**20), owners=owners,
                      keep_unowned=plan.zero_stage <= 1, comm_log=ctx.comm_log, current_action=current_action)
        self.buckets = GradBuckets([(n, p) for n, p in named_params if id(p) not in shared_ids],
                                   overlap=True, uses=uses, **common)
        self.post = GradBuckets([(n, p) for n, p in named_params if id(p) in shared_ids],
                                overlap=False, **common)

    def begin(self, num_microbatches: int) -> None:
        """Arm the overlapped buckets for a step of ``num_microbatches`` backward passes per stage."""
        self._t0 = time.perf_counter()
        if self.active:
            self.buckets.begin(num_microbatches)

    def finish(self) -> None:
        """Wait for the overlapped reductions; sum tied weights across stages; reduce those over dp."""
        if self.active:
            self.buckets.finish()
        if self.experts:
            sync_expert_gradients(self.experts, group=self.expert_axis.group, size=self.expert_axis.size,
                                  dp=self.dcp, guard=self.guard, owners=self.expert_dst, rank=self.info.rank)
        for runtime in self.zero3_runtimes:
            runtime.drain()
        sum_shared_gradients(self.shared, rank=self.info.rank, group=self.info.groups["pp"], guard=self.guard)
        if self.active:
            self.post.begin(1)
            self.post.finish()

    def launch_log(self, origin: float | None = None) -> list[tuple[int, str, float]]:
        """(bucket, action running at launch, seconds since ``origin``) of the last step's overlapped buckets.

        ``origin``: a ``time.perf_counter()`` instant, such as the executor's events' ``origin``, to put the
        launches on the events' clock; ``begin``'s instant when omitted (it runs before the schedule starts,
        so the two clocks differ by the time ``begin`` takes to zero the buffers)."""
        if not self.active:
            return []
        origin = self._t0 if origin is None else origin
        return [(b, action, t - origin) for b, action, t in self.buckets.launch_log()]
