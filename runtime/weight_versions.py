"""The weight versions of one pipeline stage under an asynchronous schedule, and its pending updates.

The live parameters are what the optimizer steps. *Version k* is their value after ``k``
updates; :class:`WeightVersions` keeps a snapshot of each version some forward or backward may
still read (weight stashing), and drops it when none can. Updates are applied lazily: the
gradient of update ``k`` accumulates microbatch by microbatch, and the update runs when version
``k + 1`` is first read (or at :meth:`apply_pending` when the pipeline drains). Lazy or eager, the
values are the same; lazy lets a weight tied across ranks exchange its gradient when both ranks
are ready, without one rank blocking the pipeline for the other.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> versions = WeightVersions([("w", w)])
    >>> versions.accumulate(0, [torch.ones(2)])
    >>> versions.apply_through(1, lambda k, grads: w.data.sub_(grads[0]))  # version 1 = after update 0
    >>> versions.snapshot(1)[0], versions.snapshot(0)[0]
    (tensor([-1., -1.]), tensor([0., 0.]))
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from autopar.errors import RuntimeCommError

__all__ = ["WeightVersions", "corrected_weights", "update_velocity"]


class WeightVersions:
    """Snapshots of a stage's weight versions, and the gradients of updates not applied yet."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]]):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.applied = 0  # updates applied to the live parameters: they hold version `applied`
        self._snapshots: dict[int, tuple[torch.Tensor, ...]] = {0: self._copy()}
        self._pending: dict[int, list[torch.Tensor]] = {}

    def _copy(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.detach().clone() for p in self.params)

    def snapshot(self, version: int) -> tuple[torch.Tensor, ...]:
        """The weights of ``version`` (read-only: steps never write into a snapshot)."""
        if version not in self._snapshots:
            raise RuntimeCommError(f"weight version {version} is not held (held: {sorted(self._snapshots)})",
                                   where="asynchronous pipeline", fix="this is a bug in the staleness rule's runtime")
        return self._snapshots[version]

    def accumulate(self, update: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one microbatch's gradients to those of ``update``."""
        total = self._pending.setdefault(update, [torch.zeros_like(p) for p in self.params])
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
            self._snapshots[self.applied] = self._copy()

    def apply_pending(self, step: Callable[[int, list[torch.Tensor]], None]) -> None:
        """Apply every update whose gradient has arrived (the drain at the end of a stream)."""
        while self.applied in self._pending:
            self.apply_through(self.applied + 1, step)

    def release_below(self, version: int) -> None:
        """Drop the snapshots older than ``version`` (nothing will read them again)."""
        for v in [v for v in self._snapshots if v < min(version, self.applied)]:
            del self._snapshots[v]

    @property
    def held(self) -> set[int]:
        """The versions whose snapshot is kept for a later read."""
        return set(self._snapshots)


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
