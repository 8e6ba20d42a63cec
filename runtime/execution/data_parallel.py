"""DataParallel as first described (``data_parallel="dataparallel"``): everything goes through dp rank 0.

A baseline, to show what DDP fixes. Each training step, per dp group (one per tp index):

1. rank 0 broadcasts the current weights (replicate);
2. rank 0 scatters the batch, one slice per dp rank;
3. every rank runs the model's forward on its slice (the graph has no loss);
4. rank 0 gathers the outputs, computes the loss over the whole batch and its gradient;
5. rank 0 scatters the output gradients; every rank runs backward from them;
6. the parameter gradients are reduced (summed) to rank 0, which alone steps the optimizer.

Rank 0 therefore holds the whole optimizer state, receives every output and sends every weight
each step: its traffic and memory grow with N while the others idle. DDP keeps a replica of the
optimizer on every rank, computes the loss locally and exchanges only gradients, in buckets that
overlap backward (:mod:`autopar.runtime.state.ddp_buckets`). Only pp=1 is supported.

``train_step`` and ``program(...)`` take the *global* batch (only dp rank 0's copy is read);
``program.shard_batch(t)`` returns ``t`` unchanged, so code written for the other modes runs as is.
The entry that lowers the model without its loss is :func:`autopar.data_parallel.compile_data_parallel`.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.utils._pytree as pytree

from autopar.ops import comm_audit as comm
from autopar.runtime.execution.program_surface import ProgramSurface
from autopar.runtime.execution.step_report import group_lrs

__all__ = ["DataParallelProgram"]

log = logging.getLogger(__name__)


class DataParallelProgram(ProgramSurface):
    """This rank's parts run as DataParallel: everything through dp rank 0 (see the module docstring)."""

    def __init__(self, *, loss_fn, **parts):
        super().__init__(**parts)
        self.loss_fn = loss_fn
        dp = self.ctx.axis("dp")
        self.size, self.dp_group, self.root, self.is_root = dp.size, dp.group, dp.ranks[0], dp.index == 0
        (self.stage,) = self.stages.values()

    def shard_batch(self, tensor):
        """The whole batch (a tensor or a dict batch): DataParallel's rank 0 scatters it itself."""
        return tensor

    # -- the collectives, each one counted --------------------------------------------------
    def _c(self) -> dict:
        return dict(group=self.dp_group, size=self.size, log=self.comm_log)

    def _scatter(self, t: torch.Tensor | None, like: torch.Tensor, purpose: str) -> torch.Tensor:
        out = torch.empty_like(like)
        parts = [p.contiguous() for p in t.chunk(self.size)] if self.is_root else None
        comm.scatter(out, parts, src=self.root, purpose=purpose, **self._c())
        return out

    def _gather(self, t: torch.Tensor, purpose: str) -> torch.Tensor | None:
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.is_root else None
        comm.gather(t.contiguous(), parts, dst=self.root, purpose=purpose, **self._c())
        return torch.cat(parts) if self.is_root else None

    def _flat_params(self, attr: str) -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
        params = [p for _, p in self.named_params]
        if attr == "data":
            return torch.cat([p.detach().reshape(-1) for p in params]), params
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]), params

    def _replicate(self) -> None:
        flat, params = self._flat_params("data")
        comm.broadcast(flat, src=self.root, purpose="param_broadcast", **self._c())
        if not self.is_root:
            _unflatten_into(flat, [p.data for p in params])

    def _reduce_gradients(self) -> None:
        flat, params = self._flat_params("grad")
        comm.reduce(flat, dst=self.root, purpose="grad_reduce", **self._c())
        if self.is_root:
            for p in params:
                p.grad = torch.empty_like(p)
            _unflatten_into(flat, [p.grad for p in params])

    # -- a step -------------------------------------------------------------------------------
    def _local_forward(self, inputs: tuple[torch.Tensor, ...]):
        local_shape = [t[: t.shape[0] // self.size] for t in inputs]
        local = [self._scatter(t, like, "batch_scatter") for t, like in zip(inputs, local_shape)]
        named = dict(zip(self.captured.input_names, local))
        return self.stage.gm(*[named[n] for n in self.stage.input_names])

    def train_step(self, *inputs, target: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch (tensors or a dict batch, read on dp rank 0); returns the
        mean loss, every rank."""
        inputs = self._batch(inputs, None, "train_step")  # a dict batch: its tensors in the graph's order
        self._flight_step()
        self.events, t0 = [], time.perf_counter()
        lrs = group_lrs(self.optimizer.param_groups)
        self.comm_log.reset()
        self.optimizer.zero_grad()
        mark = lambda name, start: self.events.append((name, start - t0, time.perf_counter() - t0))  # noqa: E731
        start = time.perf_counter()
        self._replicate()
        out = self._local_forward(inputs)
        mark("forward", start)
        flat = pytree.tree_flatten(out)[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        gathered = [self._gather(t.detach(), "output_gather") for t in tensors]
        start = time.perf_counter()
        loss = torch.zeros((), device=self.info.device)
        grads = [None] * len(tensors)
        if self.is_root:
            full = [g.requires_grad_() for g in gathered]
            it = iter(full)
            leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in flat]
            loss = self.loss_fn(pytree.tree_unflatten(leaves, self.captured.out_spec), target)
            loss.backward()
            grads = [f.grad if f.grad is not None else torch.zeros_like(f) for f in full]
            loss = loss.detach()
        mark("loss", start)
        start = time.perf_counter()
        local_grads = [self._scatter(g, t, "output_grad_scatter") for g, t in zip(grads, tensors)]
        torch.autograd.backward(tensors, local_grads)
        mark("backward", start)
        self._reduce_gradients()
        if self.is_root:
            with self.optimizer.stepping():
                self.optimizer.step()
        self.optimizer._opt_called = True  # every rank's scheduler counts this step (torch warns otherwise)
        comm.broadcast(loss, src=self.root, purpose="loss", **self._c())
        self.step_count += 1
        # the global batch (read on rank 0); no gradient norm: only rank 0 holds the gradients
        self._report(loss, lrs=lrs, grad_norm=None, inputs=tuple(inputs), start=t0, dp=1)
        return loss

    @torch.no_grad()
    def __call__(self, *inputs):
        """Forward only on the global batch (read on dp rank 0); every rank returns the whole output."""
        inputs = self._batch(inputs, None, "program(...)")
        self._replicate()
        flat = pytree.tree_flatten(self._local_forward(inputs))[0]
        result = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                whole = self._gather(x, "output_gather")
                if whole is None:
                    whole = torch.empty((x.shape[0] * self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
                comm.broadcast(whole, src=self.root, purpose="output_broadcast", **self._c())
                x = whole
            result.append(x)
        return pytree.tree_unflatten(result, self.captured.out_spec)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
