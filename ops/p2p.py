"""Pipeline point-to-point transfers as graph nodes: :class:`SendActivation` / :class:`RecvActivation`.

A value that crosses from stage a to stage b > a is one *edge*. Stage a's graph ends with a
``send_<edge>`` node; stage b's graph starts with a ``recv_<edge>`` node. Both are differentiable:
the backward of a recv sends the gradient back to stage a, and the backward of a send receives it.
So a stage's backward is one ``torch.autograd.backward`` call on its send tokens, and the p2p of
gradients happens inside it, in autograd's order, matched by tags (edge, microbatch, direction).

The nodes talk through a :class:`P2PChannel` (bound by the runtime) that knows which global rank
runs each stage; stages on the same rank hand values over locally. With the rank's
:class:`~autopar.ops.comm_guard.CommGuard` carrying a flight record, every send and every
receive's wait is an entry of it (peer, edge, microbatch), and a receive that fails runs the
job-wide diagnosis before its error is raised (:mod:`autopar.runtime.diagnostics.flight_watch`).

An edge whose shape follows a symbolic input dim (a sequence length that changes per batch) holds
``dims``, its shape with :class:`~autopar.ir.dynamic_shapes.SizeExpr` entries; the executor
sets ``channel.sizes`` ({symbol: size}) for each microbatch before its forward, and the recv node
receives into a buffer of the shape they give. The send node checks its tensor against the same
shape, so a shape the receiver would not expect is autopar's error, not a garbled transfer.
"""
from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import RuntimeCommError, ScheduleError
from autopar.ir.dynamic_shapes import is_symbolic, resolve_shape
from autopar.ops.flight_record import DONE, RECV, SEND, WAITING

__all__ = ["P2PChannel", "P2PNode", "SendActivation", "RecvActivation", "p2p_nodes", "forward_receives"]

log = logging.getLogger(__name__)
_MB_BITS = 12


def _tag(edge: int, microbatch: int, is_grad: bool) -> int:
    """A transfer's tag: its edge, direction and microbatch (modulo 4096: only a few are in flight at once)."""
    return ((edge * 2 + int(is_grad)) << _MB_BITS) | (microbatch % (1 << _MB_BITS))


class P2PChannel:
    """One rank's pipeline transfers: stage->rank map, pending sends, local hand-overs."""

    def __init__(self, *, rank: int, stage_to_rank: dict[int, int], group=None,
                 timeout_s: float = 300.0, device: torch.device | str = "cpu", guard=None):
        self.rank = rank
        self.guard = guard  # the rank's CommGuard: its flight record and failure hook (None: neither)
        self.flight = guard.flight if guard is not None else None  # the executor records actions here too
        self.device = torch.device(device)  # where received activations and gradients land
        self.stage_to_rank = dict(stage_to_rank)
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.microbatch = 0
        self.sizes: dict[str, int] = {}  # the running microbatch's symbolic dims ({symbol: size})
        self.action = "?"
        self.wait_s = 0.0  # seconds spent blocked on peers' transfers so far (traces subtract it)
        # sends not waited yet: (work, buffer, destination stage, microbatch, is_grad)
        self._pending: list[tuple[object, torch.Tensor, int, int, bool]] = []
        self.heard: dict[tuple[int, bool], int] = {}  # (source stage, is_grad) -> newest microbatch received
        self._local: dict[int, torch.Tensor] = {}
        self._posted: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}  # (src, tag) -> irecv, buffer
        self._gradients: dict[tuple[int, int], list[tuple]] = {}  # (stage, microbatch) -> its backward's receives

    def send(self, tensor: torch.Tensor, *, stage: int, edge: int, microbatch: int, is_grad: bool):
        tensor = tensor.detach().contiguous()
        dst = self.stage_to_rank[stage]
        tag = _tag(edge, microbatch, is_grad)
        if dst == self.rank:
            self._local[tag] = tensor
            return
        self._pending.append((dist.isend(tensor, dst, group=self.group, tag=tag), tensor, stage, microbatch, is_grad))
        if self.flight is not None:
            self.flight.begin(SEND, "gradient" if is_grad else "activation", stage=-1, microbatch=microbatch,
                              peer=dst, peer_stage=stage, seq=edge, state=DONE)

    def post(self, shape, dtype, *, stage: int, edge: int, microbatch: int, is_grad: bool) -> None:
        """Post the receive of a later :meth:`recv` now, so the transfer lands while this rank computes."""
        src = self.stage_to_rank[stage]
        key = (src, _tag(edge, microbatch, is_grad))
        if src != self.rank and key not in self._posted:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self._posted[key] = (dist.irecv(buffer, src, group=self.group, tag=key[1]), buffer)

    def expect_gradient(self, shape, dtype, *, stage: int, edge: int, microbatch: int, my_stage: int) -> None:
        """Note that the backward of ``(my_stage, microbatch)`` will receive this gradient from ``stage``."""
        self._gradients.setdefault((my_stage, microbatch), []).append((shape, dtype, stage, edge))

    def post_forward(self, receives, *, microbatch: int, sizes=None) -> None:
        """Post the activation receives of one forward (``receives``: :func:`forward_receives`;
        ``sizes``: that microbatch's symbolic dims)."""
        for module in receives:
            self.post(module.shape_at(sizes or {}), module.dtype, stage=module.src_stage, edge=module.edge,
                      microbatch=microbatch, is_grad=False)

    def post_backward(self, *, stage: int, microbatch: int) -> None:
        """Post the gradient receives of one backward, as its forward's sends noted them."""
        for shape, dtype, src, edge in self._gradients.pop((stage, microbatch), ()):
            self.post(shape, dtype, stage=src, edge=edge, microbatch=microbatch, is_grad=True)

    def recv(self, shape, dtype, *, stage: int, edge: int, microbatch: int, is_grad: bool,
             my_stage: int) -> torch.Tensor:
        src = self.stage_to_rank[stage]
        tag = _tag(edge, microbatch, is_grad)
        if src == self.rank:
            self._heard(stage, microbatch, is_grad)
            return self._local.pop(tag)
        self.post(shape, dtype, stage=stage, edge=edge, microbatch=microbatch, is_grad=is_grad)
        work, buffer = self._posted.pop((src, tag))
        if tuple(buffer.shape) != tuple(shape):  # posted ahead for another shape: an executor bug
            raise RuntimeCommError(f"the receive of edge {edge}, microbatch {microbatch} was posted for shape "
                                   f"{tuple(buffer.shape)} but the stage expects {tuple(shape)}",
                                   where=f"rank {self.rank}, stage {my_stage}, action {self.action}",
                                   fix="this is a bug in autopar's executor; please report it")
        what = "gradient" if is_grad else "activation"
        entry = None if self.flight is None else self.flight.begin(
            RECV, what, stage=my_stage, microbatch=microbatch, peer=src, peer_stage=stage, seq=edge, state=WAITING)
        began = time.perf_counter()
        try:
            work.wait(self.timeout)
            waited = time.perf_counter() - began
            self.wait_s += waited
        except Exception as exc:  # noqa: BLE001 - a timeout or a dead peer
            error = RuntimeCommError(
                f"waiting for the {what} of edge {edge}, microbatch {microbatch} failed: {exc}",
                where=f"rank {self.rank}, stage {my_stage}, action {self.action}, peer rank {src} "
                      f"(stage {stage})",
                fix="check that the peer rank is alive and runs the same schedule; raise "
                    "p2p_timeout_s if the peer is only slow")
            if entry is not None:
                self.flight.end(entry, failed=True)
            raise (self.guard.diagnosed(error) if self.guard is not None else error) from exc
        if entry is not None:
            self.flight.end(entry)
            if waited > self.flight.longest_wait[0]:
                self.flight.longest_wait = (waited, entry)
        self._heard(stage, microbatch, is_grad)
        return buffer

    def _heard(self, stage: int, microbatch: int, is_grad: bool) -> None:
        self.heard[(stage, is_grad)] = max(microbatch, self.heard.get((stage, is_grad), microbatch))

    def prune(self, taken: Callable[[int, int, bool], bool]) -> None:
        """Finish the sends a receiver has taken, ``taken(stage, microbatch, is_grad)``; the rest stay pending.

        For a pipeline that never drains (runtime/execution/async_pipeline.py): gloo reports a send complete only
        once it is waited on, and a wait returns only once the receiver has posted its receive, so only
        a send the caller knows was taken (from what that stage has sent since) is waited on here."""
        keep = []
        for work, tensor, stage, microbatch, is_grad in self._pending:
            if work.is_completed() or taken(stage, microbatch, is_grad):
                work.wait()
            else:
                keep.append((work, tensor, stage, microbatch, is_grad))
        self._pending = keep

    def flush(self) -> None:
        """Wait for every send of this step (their buffers stay alive until then)."""
        for work, *_ in self._pending:
            work.wait()
        self._pending.clear()
        self.heard.clear()
        self._gradients.clear()  # (a backward whose receives were not posted ahead posted them itself)
        if self._posted:  # every posted receive is one the schedule's next action reads
            raise RuntimeCommError(f"{len(self._posted)} posted receives were never read: "
                                   f"{sorted(self._posted)}", where=f"rank {self.rank}, end of the step",
                                   fix="this is a bug in autopar's executor; please report it")


class _SendFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        ctx.module, ctx.microbatch = module, module.channel.microbatch
        ctx.shape, ctx.dtype = x.shape, x.dtype
        module.channel.send(x, stage=module.dst_stage, edge=module.edge, microbatch=ctx.microbatch,
                            is_grad=False)
        module.channel.expect_gradient(x.shape, x.dtype, stage=module.dst_stage, edge=module.edge,
                                       microbatch=ctx.microbatch, my_stage=module.src_stage)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        m = ctx.module
        grad = m.channel.recv(ctx.shape, ctx.dtype, stage=m.dst_stage, edge=m.edge,
                              microbatch=ctx.microbatch, is_grad=True, my_stage=m.src_stage)
        return grad, None


class _RecvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _anchor, module):
        ctx.module, ctx.microbatch = module, module.channel.microbatch
        return module.receive()

    @staticmethod
    def backward(ctx, grad):
        m = ctx.module
        m.channel.send(grad, stage=m.src_stage, edge=m.edge, microbatch=ctx.microbatch, is_grad=True)
        return None, None


class P2PNode(nn.Module):
    """A send or recv node of a stage graph: one edge between two stages, run over the bound channel."""

    def __init__(self, *, edge: int, src_stage: int, dst_stage: int, shape, dtype, requires_grad, dims=None):
        super().__init__()
        self.edge, self.src_stage, self.dst_stage = edge, src_stage, dst_stage
        self.shape, self.dtype, self.requires_grad = tuple(shape), dtype, requires_grad
        # the shape with SizeExprs where it follows a symbolic input dim (None: always ``shape``)
        self.dims = tuple(dims) if dims is not None and is_symbolic(dims) else None
        self.channel: P2PChannel | None = None
        self.grad_by_executor = False  # split backward: the executor sends this value's gradient

    def shape_at(self, sizes) -> tuple[int, ...]:
        """The edge's shape for a microbatch of symbolic dims ``sizes`` ({symbol: size})."""
        return self.shape if self.dims is None else resolve_shape(self.dims, sizes)

    def bind(self, channel: P2PChannel) -> None:
        self.channel = channel

    def _require_channel(self) -> P2PChannel:
        if self.channel is None:
            raise RuntimeCommError(f"{type(self).__name__} of edge {self.edge} is not bound",
                                   where=f"stage {self.src_stage} -> {self.dst_stage}",
                                   fix="run stage graphs through autopar.compile(); plan() graphs are for reading")
        return self.channel

    def extra_repr(self) -> str:
        shape = list(self.shape) if self.dims is None else "[" + ", ".join(str(d) for d in self.dims) + "]"
        return (f"edge={self.edge}, stage {self.src_stage} -> {self.dst_stage}, shape={shape}, "
                f"dtype={self.dtype}, grad={self.requires_grad}")


class SendActivation(P2PNode):
    """Send a value to a later stage; returns a scalar token whose backward receives the grad."""

    def forward(self, x):
        channel = self._require_channel()
        expected = self.shape_at(channel.sizes)
        if tuple(x.shape) != expected:
            raise ScheduleError(f"stage {self.src_stage} sends a tensor of shape {tuple(x.shape)} on edge {self.edge}, "
                                f"but stage {self.dst_stage} receives {expected} for this batch",
                                where=f"rank {channel.rank}, action {channel.action}, send_{self.edge}",
                                fix="give every rank of a pipeline the same batch (the same shapes); if they do, "
                                    "this is a bug in autopar: compile with dynamic_shapes='static'")
        if self.requires_grad and torch.is_grad_enabled() and x.requires_grad:
            return _SendFn.apply(x, self)
        channel.send(x, stage=self.dst_stage, edge=self.edge, microbatch=channel.microbatch,
                     is_grad=False)
        return x.new_zeros(())

    def meta_forward(self, x):
        return x.new_zeros(())


class RecvActivation(P2PNode):
    """Receive a value from an earlier stage; its backward sends the gradient back."""

    def receive(self) -> torch.Tensor:
        channel = self._require_channel()
        return channel.recv(self.shape_at(channel.sizes), self.dtype, stage=self.src_stage, edge=self.edge,
                            microbatch=channel.microbatch, is_grad=False, my_stage=self.dst_stage)

    def forward(self):
        if self.requires_grad and torch.is_grad_enabled():
            if self.grad_by_executor:
                return self.receive().requires_grad_()
            anchor = torch.zeros((), requires_grad=True, device=self._require_channel().device)
            return _RecvFn.apply(anchor, self)
        return self.receive()

    def meta_forward(self):
        return torch.empty(self.shape, dtype=self.dtype, device="cpu")  # shape propagation runs on fake CPU tensors


def forward_receives(gm) -> list[RecvActivation]:
    """The recv nodes of a stage graph: what each forward of it receives."""
    return [m for m in (gm.get_submodule(n.target) for n in p2p_nodes(gm)) if isinstance(m, RecvActivation)]


def p2p_nodes(gm) -> list:
    """The send and recv call_module nodes of a stage graph."""
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), P2PNode)]
