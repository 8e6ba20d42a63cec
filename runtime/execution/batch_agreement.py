"""What the dp ranks agree on before a step runs: each one's rows, whether any refused its batch, the token counts.

One all-reduce over dp, before any stage runs (none with dp=1), carries each dp rank's row count
(its own slot of a vector of ``dp`` slots), a flag for each rank whose batch was refused, and the
label-token counts of a token-mean loss (:mod:`autopar.runtime.execution.item_count`, which already took
this all-reduce). So:

- a batch one rank refuses (a length past the bound, a partial batch the schedule cannot take)
  stops the step on every rank, each with autopar's error, instead of leaving the others waiting;
- a partial batch weighs every row as one device does. A token-mean loss does so by its counts. Any
  other loss is taken as a mean over its microbatch's rows: microbatch ``i`` of dp rank ``r``
  (``n_i`` rows of the rank's ``k_r`` microbatches) gets the weight ``n_i · k_r · dp / N`` (``N``:
  the step's rows), which the executor multiplies its loss by (:func:`add_row_weights`); the
  executor's 1/k_r and the dp average then make the step's gradient ``sum_i n_i / N · grad_i``.
  With every microbatch full the weights are 1 and are not applied.

Example (one process)::

    >>> rows = read_agreement(agreement_riders(rows=3, refused=False, dp_index=0, dp_size=1), dp_size=1)
    >>> rows.rows, rows.refused
    ((3,), ())
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.ir.captured_graph import LOSS_WEIGHT

__all__ = ["StepRows", "agreement_riders", "read_agreement", "add_row_weights"]


@dataclass(frozen=True)
class StepRows:
    """Every dp rank's rows this step, and the dp ranks that refused their batch."""

    rows: tuple[int, ...]
    refused: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.rows)


def agreement_riders(*, rows: int, refused: bool, dp_index: int, dp_size: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's part of the agreement: its rows and its refusal flag, each in its own slot (float64, on
    ``device``: the rank's, where the dp all-reduce runs)."""
    out = torch.zeros(2 * dp_size, dtype=torch.float64, device=device)
    out[dp_index] = rows
    out[dp_size + dp_index] = float(refused)
    return out


def read_agreement(summed: torch.Tensor, *, dp_size: int) -> StepRows:
    """The agreement after its all-reduce over dp."""
    values = [int(round(v)) for v in summed.tolist()]
    return StepRows(rows=tuple(values[:dp_size]), refused=tuple(i for i, v in enumerate(values[dp_size:]) if v))


def add_row_weights(microbatches: list[dict], *, step: StepRows, dp_size: int) -> None:
    """Weigh each microbatch's loss by its rows (module docstring), in place; nothing when every row count is
    the same (the plain mean over microbatches and dp is then exact)."""
    sizes = [int(next(iter(mb.values())).shape[0]) for mb in microbatches]
    if len(set(step.rows)) == 1 and len(set(sizes)) == 1 and step.rows[0] == sum(sizes):
        return
    k, total = len(microbatches), step.total
    for mb, n in zip(microbatches, sizes):
        device = next(iter(mb.values())).device
        mb[LOSS_WEIGHT] = torch.tensor(n * k * dp_size / total, dtype=torch.float32, device=device)
