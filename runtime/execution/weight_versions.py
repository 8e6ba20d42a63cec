"""The weight versions of one pipeline stage under an asynchronous schedule, and its pending updates.

The live parameters are what the optimizer steps. *Version k* is their value after ``k``
updates. A forward that stashes (PipeDream, 2BW) reads the live version through
:meth:`WeightVersions.read`: the live parameters themselves when no update comes before its
backward, else a copy, made at the first such read and shared by the reads of the same version
until the last of their backwards is :meth:`~WeightVersions.done`. So a stage holds one copy per
version its in-flight microbatches read across an update (the schedule's staleness bounds them:
``p - 1 - s`` on stage ``s`` under PipeDream) and none for a version no one reads (PipeMare reads
the live weights). Updates are applied lazily: the gradient of update ``k`` accumulates
microbatch by microbatch (the first microbatch's gradient becomes the buffer), and the update runs
when version ``k + 1`` is first read (or at :meth:`~WeightVersions.apply_pending` when the
pipeline drains). Lazy or eager, the values are the same; lazy lets a weight tied across ranks
exchange its gradient when both ranks are ready, without one rank blocking the pipeline for the
other.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> versions = WeightVersions([("w", w)])
    >>> before = versions.read(0, copy=True, microbatch=0)  # read across an update: a copy
    >>> versions.accumulate(0, [torch.ones(2)])
    >>> versions.apply_through(1, lambda k, grads: w.data.sub_(grads[0]))  # version 1 = after update 0
    >>> versions.read(1, copy=False, microbatch=1)[0], before[0], len(versions.buffers())
    (tensor([-1., -1.]), tensor([0., 0.]), 1)
    >>> versions.done(0)  # microbatch 0's backward ran: its copy goes
    >>> versions.buffers()
    []
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from autopar.errors import RuntimeCommError

__all__ = ["WeightVersions", "corrected_weights", "update_velocity"]


class WeightVersions:
    """The live weights as stashing forwards read them (copies where an update comes first), and pending updates."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]]):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.applied = 0  # updates applied to the live parameters: they hold version `applied`
        self._copies: dict[int, tuple[torch.Tensor, ...]] = {}  # version -> its copy, while a reader is in flight
        self._readers: dict[int, int] = {}  # in-flight microbatch -> the version whose copy it read
        self._pending: dict[int, list[torch.Tensor]] = {}

    def read(self, version: int, *, copy: bool, microbatch: int) -> tuple[torch.Tensor, ...]:
        """The weights of ``version`` (the live one) for ``microbatch``'s forward, new tensors that share
        the parameters' storage or, with ``copy``, that of a copy no step writes into (kept until
        :meth:`done`). Without ``copy``, autograd's version counters refuse a backward through weights
        a step changed since."""
        if version != self.applied:
            raise RuntimeCommError(f"weight version {version} is read while the live weights are version "
                                   f"{self.applied}", where="asynchronous pipeline",
                                   fix="this is a bug in the staleness rule's runtime")
        if not copy:
            return tuple(p.detach() for p in self.params)
        if version not in self._copies:
            self._copies[version] = tuple(p.detach().clone() for p in self.params)
        self._readers[microbatch] = version
        return tuple(t.detach() for t in self._copies[version])

    def done(self, microbatch: int) -> None:
        """``microbatch``'s backward ran: its copy goes when no other reader of it is in flight."""
        version = self._readers.pop(microbatch, None)
        if version is not None and version not in self._readers.values():
            del self._copies[version]

    def accumulate(self, update: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one microbatch's gradients to those of ``update`` (the first microbatch's become its buffers)."""
        total = self._pending.get(update)
        if total is None:
            self._pending[update] = [g.detach() if g is not None else torch.zeros_like(p)
                                     for g, p in zip(grads, self.params)]
            return
        for acc, grad in zip(total, grads):
            if grad is not None:
                acc.add_(grad)

    def apply_through(self, version: int, step: Callable[[int, list[torch.Tensor]], None]) -> None:
        """Apply pending updates until the live weights are ``version``; ``step(k, grads)`` updates them."""
        while self.applied < version:
            if self.applied not in self._pending:
                raise RuntimeCommError(f"version {version} is read before the gradient of update {self.applied} "
                                       "exists", where="asynchronous pipeline",
                                       fix="the schedule order does not fit its staleness rule")
            step(self.applied, self._pending.pop(self.applied))
            self.applied += 1

    def apply_pending(self, step: Callable[[int, list[torch.Tensor]], None]) -> None:
        """Apply every update whose gradient has arrived (the drain at the end of a stream)."""
        while self.applied in self._pending:
            self.apply_through(self.applied + 1, step)

    @property
    def held(self) -> set[int]:
        """The versions whose copy is kept (for the forwards in flight that read it)."""
        return set(self._copies)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor held besides the live weights: the copies kept and the pending updates' gradients."""
        return [t for ts in self._copies.values() for t in ts] + [g for grads in self._pending.values() for g in grads]


def corrected_weights(params: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], lag: int) -> list[torch.Tensor]:
    """PipeMare's backward weights: ``w - lag * delta``, new tensors (``w`` copied when ``lag`` is 0)."""
    if lag == 0:
        return [p.detach().clone() for p in params]
    return [p.detach() - lag * d for p, d in zip(params, delta)]


def update_velocity(delta: Sequence[torch.Tensor], old: Sequence[torch.Tensor], new: Sequence[torch.Tensor], *,
                    decay: float) -> None:
    """PipeMare's ``delta <- decay * delta + (1 - decay) * (new - old)``, in place."""
    for d, o, n in zip(delta, old, new):
        d.mul_(decay).add_(n.detach() - o, alpha=1.0 - decay)
