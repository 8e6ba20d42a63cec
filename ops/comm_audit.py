"""Counted collectives over the data-parallel axis, and the bytes ZeRO's theory says they should move.

Every dp collective of the runtime (DDP buckets, ZeRO reductions and broadcasts, ZeRO-3's graph
gathers, DataParallel's scatter/gather) goes through the wrappers here, which append one
:class:`CommRecord` to the program's :class:`CommLog` and run the collective under the log's
:class:`~autopar.ops.comm_guard.CommGuard` (a deadline and autopar's error; the handle an
``async_op=True`` call returns keeps both). A record holds the payload and the bytes
*this rank sends* under the bandwidth-optimal ring algorithms, for a group of N ranks and a
payload of n bytes (the whole, unsharded buffer):

=====================  ====================  ==========================================
collective              bytes sent per rank   note
=====================  ====================  ==========================================
all-reduce              2n(N-1)/N             reduce-scatter then all-gather
reduce-scatter          n(N-1)/N
all-gather              n(N-1)/N              n is the gathered (output) size
reduce, broadcast       n(N-1)/N              pipelined ring, averaged over the ranks
scatter (root)          n(N-1)/N              the root sends every other rank its part
gather (non-root)       n/N                   each rank sends its part to the root
=====================  ====================  ==========================================

:func:`theory_bytes` gives the per-step figure ZeRO's paper predicts for a rank holding
Ψ bytes of parameters: DDP, ZeRO-1 and ZeRO-2 send 2Ψ(N-1)/N, ZeRO-3 3Ψ(N-1)/N (1.5x) per
forward/backward pass.

Example::

    >>> from autopar.ops.comm_audit import theory_bytes
    >>> theory_bytes(zero_stage=3, param_bytes=1000, dp=2) / theory_bytes(zero_stage=0, param_bytes=1000, dp=2)
    1.5
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.ops.comm_guard import CommGuard

__all__ = ["CommRecord", "CommLog", "all_reduce", "reduce", "broadcast", "all_gather_into",
           "reduce_scatter_into", "scatter", "gather", "theory_bytes"]


@dataclass(frozen=True)
class CommRecord:
    """One collective this rank took part in."""

    op: str
    purpose: str
    payload_bytes: int
    sent_bytes: float
    group_size: int


@dataclass
class CommLog:
    """The dp collectives of one training step (reset by the program at each step's start)."""

    records: list[CommRecord] = field(default_factory=list)
    guard: CommGuard | None = None  # the program's deadline for these collectives (ops/comm_guard.py)

    def reset(self) -> None:
        self.records.clear()

    def add(self, op: str, purpose: str, payload: int, sent: float, size: int) -> None:
        self.records.append(CommRecord(op, purpose, payload, sent, size))

    def sent_bytes(self, *, op: str | None = None, purpose: str | None = None) -> float:
        """Bytes this rank sent, optionally only for one op or purpose."""
        return sum(r.sent_bytes for r in self.records
                   if (op is None or r.op == op) and (purpose is None or r.purpose == purpose))

    def by_purpose(self) -> dict[str, float]:
        """Bytes sent per purpose (``grad_all_reduce``, ``param_broadcast``, ``zero3_gather`` ...)."""
        out: dict[str, float] = {}
        for r in self.records:
            out[r.purpose] = out.get(r.purpose, 0.0) + r.sent_bytes
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _log(log: CommLog | None, op: str, purpose: str, payload: int, sent: float, size: int) -> None:
    if log is not None:
        log.add(op, purpose, payload, sent, size)


def _issue(log: CommLog | None, op: str, purpose: str, fn, /, *args, group, async_op: bool, **kwargs):
    """``fn(*args, ...)`` under the log's guard when it has one; else plainly."""
    if log is not None and log.guard is not None:
        return log.guard.run(op, fn, *args, group=group, purpose=purpose, async_op=async_op, **kwargs)
    return fn(*args, group=group, async_op=async_op, **kwargs)


def all_reduce(t: torch.Tensor, *, group, size: int, log: CommLog | None, purpose: str, async_op=False):
    """Sum ``t`` in place over ``group``."""
    _log(log, "all_reduce", purpose, _nbytes(t), 2 * _nbytes(t) * (size - 1) / size, size)
    return _issue(log, "all_reduce", purpose, dist.all_reduce, t, group=group, async_op=async_op)


def reduce(t: torch.Tensor, *, dst: int, group, size: int, log: CommLog | None, purpose: str, async_op=False):
    """Sum ``t`` onto global rank ``dst``."""
    _log(log, "reduce", purpose, _nbytes(t), _nbytes(t) * (size - 1) / size, size)
    return _issue(log, "reduce", purpose, dist.reduce, t, dst=dst, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, *, src: int, group, size: int, log: CommLog | None, purpose: str, async_op=False):
    """Copy ``t`` from global rank ``src`` to every rank of ``group``."""
    _log(log, "broadcast", purpose, _nbytes(t), _nbytes(t) * (size - 1) / size, size)
    return _issue(log, "broadcast", purpose, dist.broadcast, t, src=src, group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, *, group, size: int, log: CommLog | None,
                    purpose: str, async_op=False):
    """``out`` (N x the shard) = every rank's ``inp`` in rank order."""
    _log(log, "all_gather", purpose, _nbytes(out), _nbytes(out) * (size - 1) / size, size)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10+
    return _issue(log, "all_gather", purpose, fn, out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, *, group, size: int, log: CommLog | None,
                        purpose: str, async_op=False):
    """``out`` = this rank's 1/N block of the sum of every rank's ``inp``."""
    _log(log, "reduce_scatter", purpose, _nbytes(inp), _nbytes(inp) * (size - 1) / size, size)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _issue(log, "reduce_scatter", purpose, fn, out, inp, group=group, async_op=async_op)


def scatter(out: torch.Tensor, parts: list[torch.Tensor] | None, *, src: int, group, size: int,
            log: CommLog | None, purpose: str):
    """Root ``src`` sends part i to the i-th rank of ``group``; ``parts`` only on the root."""
    sent = sum(_nbytes(p) for p in parts) * (size - 1) / size if parts is not None else 0.0
    _log(log, "scatter", purpose, _nbytes(out) * size, sent, size)
    return _issue(log, "scatter", purpose, dist.scatter, out, parts, src=src, group=group, async_op=False)


def gather(t: torch.Tensor, parts: list[torch.Tensor] | None, *, dst: int, group, size: int,
           log: CommLog | None, purpose: str):
    """Every rank's ``t`` into ``parts`` on root ``dst`` (``parts`` only on the root)."""
    _log(log, "gather", purpose, _nbytes(t) * size, 0.0 if parts is not None else float(_nbytes(t)), size)
    return _issue(log, "gather", purpose, dist.gather, t, parts, dst=dst, group=group, async_op=False)


def theory_bytes(*, zero_stage: int, param_bytes: float, dp: int, num_microbatches: int = 1) -> float:
    """Bytes one rank sends per step over dp in theory (ZeRO paper, section 7), for Ψ = ``param_bytes``.

    DDP and ZeRO-1/2 reduce the gradients once per step (after the last microbatch) and, for
    ZeRO-1/2, gather the updated parameters: 2Ψ(N-1)/N. ZeRO-3 gathers the parameters for each
    forward and again for each backward and reduce-scatters the gradients, every microbatch:
    3Ψ(N-1)/N per microbatch.
    """
    if dp == 1:
        return 0.0
    share = param_bytes * (dp - 1) / dp
    return 3 * share * num_microbatches if zero_stage == 3 else 2 * share
