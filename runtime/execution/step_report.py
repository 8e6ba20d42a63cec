"""What a training step reports: ``program.last_step``, a :class:`StepReport` after each ``train_step``.

Every field is known on every rank without a collective of its own:

- ``loss``: the step's global mean loss (what ``train_step`` returned).
- ``lrs``: each parameter group's learning rate the step used (``program.optimizer.param_groups``, the
  same on every rank); under the asynchronous schedules those of the batch fed
  (docs/training_loop.md), which its updates step with.
- ``grad_norm``: the global 2-norm of the whole model's gradient before clipping, each parameter
  counted once over every shard, stage and replica (:mod:`autopar.runtime.state.clip`). Each rank sums the
  squares of the gradients it counts, and the sum rides on the all-reduce the step already makes for
  its non-finite check and its loss (:func:`autopar.runtime.execution.numerics.check_finite`); clipping uses
  the same norm, so it costs no collective of its own either. The price is one norm per counted
  gradient tensor each step (a read of this rank's share of the gradients). None under the
  asynchronous schedules (each stage updates on its own clock: no step-wide gradient) and the
  DataParallel baseline.
- ``num_samples``, ``num_tokens``: rows of the global batch and the elements of its token ids (the
  first integer input of two or more dims; None without one), from the shapes: every dp rank's
  slice has the same shape.
- ``seconds``: this rank's wall time of the ``train_step`` call, and ``samples_per_s`` /
  ``tokens_per_s`` from it.

    >>> report = StepReport(step=3, loss=2.5, lrs=(1e-3, 5e-4), grad_norm=0.7, num_samples=8, num_tokens=256,
    ...                     seconds=0.5)
    >>> report.lr, report.samples_per_s, report.tokens_per_s
    (0.001, 16.0, 512.0)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["StepReport", "group_lrs", "batch_counts"]


@dataclass(frozen=True)
class StepReport:
    """One finished ``train_step``, as every rank sees it (see the module doc)."""

    step: int  # optimizer steps completed (program.step_count after this one)
    loss: float
    lrs: tuple[float, ...]  # each parameter group's learning rate in this step
    grad_norm: float | None  # global gradient norm before clipping
    num_samples: int  # rows of the global batch
    num_tokens: int | None  # elements of the global batch's token ids
    seconds: float  # this rank's wall time of the call

    @property
    def lr(self) -> float:
        """The first group's learning rate."""
        return self.lrs[0]

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.seconds

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.num_tokens is None else self.num_tokens / self.seconds


def group_lrs(groups: Sequence[Mapping]) -> tuple[float, ...]:
    """Each group's ``lr`` as a float (a tensor learning rate read out)."""
    return tuple(float(g["lr"]) for g in groups if "lr" in g)


def batch_counts(inputs: Sequence[torch.Tensor], *, dp: int) -> tuple[int, int | None]:
    """(rows, token-id elements) of the global batch from one dp rank's ``inputs`` (the graph's inputs in
    order, the loss target excluded); tokens: the first integer tensor of two or more dims."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    rows = tensors[0].shape[0] * dp if tensors and tensors[0].dim() else 0
    ids = next((t for t in tensors if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()
                and t.dtype != torch.bool), None)
    return rows, None if ids is None else ids.numel() * dp
