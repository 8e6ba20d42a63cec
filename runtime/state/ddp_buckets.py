"""DDP's gradient buckets: reduce gradients over dp while backward is still running.

Parameters are put into buckets of about ``bucket_bytes`` in *reverse* order of use (the order
backward produces their gradients). Each parameter has a post-accumulate-grad hook; a step
expects ``num_microbatches x (local stage graphs using it)`` accumulations, so the hook knows
when a gradient is final, the way DDP's ``no_sync`` skips every microbatch but the last.
When every parameter of a bucket is final, an asynchronous collective starts on the bucket's flat
buffer (its gradients already are views of it, or are copied in), while autograd goes on with
earlier layers.
A bucket whose reduced gradients this rank keeps (every bucket under DDP, the owned ones under
ZeRO-1/2) keeps its flat buffer from step to step, its gradients are views of it, and backward
accumulates into them in place (torch DDP's ``gradient_as_bucket_view=True``): a fresh
buffer per bucket per step cost this rank 5-10 ms of a 0.76 s GPT 8x256 step in allocation and
first touch (torch.profiler, ``aten::cat``; torch DDP's bucket copies took 1.8-2.6 ms).
:meth:`GradBuckets.finish` (before the optimizer step) starts the buckets that never completed
(a parameter that got no gradient counts as zero), waits for all of them in launch order and
divides the kept ones by N. A kept bucket's gradients become views of its flat buffer as soon as it
is launched (no second copy of the gradients, and the ones autograd made are freed mid-backward).

Two modes:
- ``owners=None`` (DDP, ZeRO-0): all-reduce each bucket and divide by N.
- ``owners={name: dp index}`` (ZeRO-1/2): buckets hold the parameters of one owner only and are
  *reduced* to it; the owner divides by N. Other ranks keep their local gradient (ZeRO-1) or drop
  it as soon as the bucket is launched (ZeRO-2), so only owned gradients outlive the step.

Launch order is the hooks' order, identical on every dp rank (same graphs, same schedule), so
the collectives match. Gradients set without autograd's accumulation (the W action of split
backward) do not fire the hooks; their buckets start in :meth:`finish`.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from autopar.errors import RuntimeCommError
from autopar.ops import comm_audit as comm
from autopar.runtime.execution.rank_context import AxisGroup

__all__ = ["GradBuckets", "Bucket", "plan_buckets"]

log = logging.getLogger(__name__)


@dataclass
class Bucket:
    """Parameters reduced together, and their state during a step."""

    index: int
    names: list[str]
    owner: int | None = None  # dp index the bucket is reduced to; None: all-reduce
    ready: int = 0
    flat: torch.Tensor | None = None
    buffer: torch.Tensor | None = None  # the flat buffer kept between steps (buckets this rank keeps)
    work: object = None
    launched_at: float | None = None
    launched_in: str = ""


def plan_buckets(named: list[tuple[str, torch.nn.Parameter]], *, bucket_bytes: int,
                 owners: dict[str, int] | None) -> list[Bucket]:
    """Buckets in reverse use order (``named`` is in use order), one owner per bucket if ``owners``."""
    buckets: list[Bucket] = []
    open_: dict[int | None, tuple[list[str], int]] = {}
    for name, p in reversed(named):
        owner = owners[name] if owners is not None else None
        names, size = open_.get(owner, ([], 0))
        nbytes = p.numel() * p.element_size()
        if names and size + nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), names, owner))
            names, size = [], 0
        open_[owner] = (names + [name], size + nbytes)
    for owner, (names, _) in sorted(open_.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        if names:
            buckets.append(Bucket(len(buckets), names, owner))
    return buckets


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``tensor`` shares memory with ``buffer``."""
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


class GradBuckets:
    """Bucketed dp reduction of ``named`` parameters' gradients, overlapped with backward if ``overlap``."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], *, dp: AxisGroup,
                 bucket_bytes: int, owners: dict[str, int] | None = None,
                 keep_unowned: bool = True, overlap: bool = True, uses: dict[str, int] | None = None,
                 comm_log: comm.CommLog | None = None, current_action: Callable[[], str] = lambda: "",
                 purpose: str = "grad"):
        self.params = dict(named)
        self.group, self.dp_ranks, self.dp_rank, self.size = dp.group, list(dp.ranks), dp.index, dp.size
        self.keep_unowned = keep_unowned
        self.overlap = overlap and self.size > 1
        self.comm_log, self.current_action, self.purpose = comm_log, current_action, purpose
        self.buckets = plan_buckets(list(named), bucket_bytes=bucket_bytes, owners=owners)
        self.bucket_of = {n: b for b in self.buckets for n in b.names}
        self.uses = uses or {}
        self.expected: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.launched: list[Bucket] = []
        self.armed = False
        self._handles = []
        if self.overlap:
            for name, p in named:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    # -- a step ------------------------------------------------------------------------------
    def begin(self, num_microbatches: int) -> None:
        """Arm the hooks for a step of ``num_microbatches`` backward passes per stage."""
        self.expected = {n: num_microbatches * self.uses.get(n, 1) for n in self.params}
        self.counts = dict.fromkeys(self.params, 0)
        for b in self.buckets:
            b.ready, b.flat, b.work, b.launched_at, b.launched_in = 0, None, None, None, ""
            if b.buffer is not None and self.overlap:  # (no overlap: the gradients exist before begin)
                b.buffer.zero_()
                self._point_grads_at(b, b.buffer)
        self.launched = []
        self.armed = True

    def _hook(self, name: str):
        # the hook lives on the parameter (in C++, out of the garbage collector's sight): a strong reference
        # to the buckets would keep them, the program and every tensor it holds alive after it is dropped
        owner = weakref.ref(self)

        def on_grad(param: torch.Tensor) -> None:
            buckets = owner()
            if buckets is not None and buckets.armed:
                buckets._counted(name)
        return on_grad

    def _counted(self, name: str) -> None:
        """One more accumulation of ``name``'s gradient: launch its bucket when all of it is in."""
        bucket = self.bucket_of[name]
        if bucket.work is not None:
            raise RuntimeCommError(f"gradient of {name} accumulated again after its bucket was reduced",
                                   where=f"dp bucket {bucket.index}",
                                   fix="report this: the step ran more backward passes than planned")
        self.counts[name] += 1
        if self.counts[name] == self.expected[name]:
            bucket.ready += 1
            if bucket.ready == len(bucket.names):
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.flat = self._gather(bucket)
        if self._keeps(bucket):
            bucket.buffer = bucket.flat
            self._point_grads_at(bucket, bucket.flat)
        bucket.launched_at, bucket.launched_in = time.perf_counter(), self.current_action()
        if bucket.owner is None:
            bucket.work = comm.all_reduce(bucket.flat, group=self.group, size=self.size, log=self.comm_log,
                                          purpose=f"{self.purpose}_all_reduce", async_op=True)
        else:
            bucket.work = comm.reduce(bucket.flat, dst=self.dp_ranks[bucket.owner], group=self.group,
                                      size=self.size, log=self.comm_log, purpose=f"{self.purpose}_reduce",
                                      async_op=True)
            if bucket.owner != self.dp_rank and not self.keep_unowned:
                for n in bucket.names:  # ZeRO-2 frees now; ZeRO-1 keeps the local gradient
                    self.params[n].grad = None
        self.launched.append(bucket)

    def _keeps(self, bucket: Bucket) -> bool:
        """Whether this rank keeps the bucket's reduced gradients (and so its flat buffer)."""
        return bucket.owner is None or bucket.owner == self.dp_rank

    def _gather(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's gradients in one flat tensor: its kept buffer, refilled, where it has one."""
        params = [self.params[n] for n in bucket.names]
        buffer = bucket.buffer
        if buffer is None or any(p.grad is not None and p.grad.dtype != buffer.dtype for p in params):
            return torch.cat([p.grad.reshape(-1) if p.grad is not None
                              else torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params])
        if all(p.grad is not None and not _inside(p.grad, buffer) for p in params):
            return torch.cat([p.grad.reshape(-1) for p in params], out=buffer)
        offset = 0  # some gradients already are views of the buffer (not set to None since): copy the rest
        for p in params:
            target = buffer[offset: offset + p.numel()].view_as(p)
            if p.grad is None:
                target.zero_()
            elif not (p.grad.data_ptr() == target.data_ptr() and p.grad.stride() == target.stride()):
                target.copy_(p.grad)
            offset += p.numel()
        return buffer

    def finish(self) -> None:
        """Start what is left (in bucket order), wait for everything, write the reduced gradients back."""
        if self.size == 1:
            return
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.launched:
            bucket.work.wait()
            self._write_back(bucket)
        self.armed = False

    def _point_grads_at(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Make the bucket's gradients views of ``flat``, its buffer.

        At :meth:`begin` of overlapped buckets (the buffer zeroed), so that backward adds into
        the buffer in place, as torch DDP's ``gradient_as_bucket_view=True``; and at launch, for
        gradients that arrived as tensors of their own (the first step, buckets without
        overlap): freeing those then lets the rest of backward reuse their memory. Gradients of
        their own kept to the step's end were freed together after it, glibc gave the top of the
        heap back to the system, and every step faulted it in again (2,000-6,000 minor page
        faults a GPT 8x256 DDP step; 200-1,400 since, torch DDP 0-20). The views are read only
        after :meth:`finish` has waited for the reduction; they count as sums this parameter
        owns, so a W adds into them in place (executor ``_accumulate``).
        """
        offset = 0
        for n in bucket.names:
            p = self.params[n]
            view = flat[offset: offset + p.numel()].view_as(p)
            view._autopar_owned_sum = True
            p.grad = view
            offset += p.numel()

    def _write_back(self, bucket: Bucket) -> None:
        if self._keeps(bucket):
            bucket.flat.div_(self.size)  # the gradients already are its views (_point_grads_at)
        bucket.flat, bucket.work = None, None

    def launch_log(self) -> list[tuple[int, str, float]]:
        """(bucket index, action running at launch, perf_counter time) of the last step's launches."""
        return [(b.index, b.launched_in, b.launched_at) for b in self.launched]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
