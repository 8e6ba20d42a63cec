"""A rank's batch, checked and cut into microbatches: a partial batch gets fewer or smaller microbatches.

The program is compiled for ``count`` microbatches of ``size`` rows on every dp rank. A batch of
that many rows is cut as before. A batch with fewer (an epoch's last batch, or a dp rank that got
fewer rows of it) is cut into microbatches of ``size`` rows and one smaller last one, when the
schedule runs that many microbatches (1F1B needs at least pp); otherwise into ``count``
microbatches as equal as they come (their sizes differ by at most one row). The loss and the
gradients then weigh each row as one device does (:mod:`autopar.runtime.execution.batch_agreement`).

Example::

    >>> microbatch_rows(8, size=2, count=4, takes=lambda k: k >= 2)
    [2, 2, 2, 2]
    >>> microbatch_rows(5, size=2, count=4, takes=lambda k: k >= 2)
    [2, 2, 1]
    >>> microbatch_rows(3, size=4, count=2, takes=lambda k: k >= 2)
    [2, 1]
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.errors import InputError, PlanError

__all__ = ["batch_rows", "microbatch_rows", "cut_rows", "FIX_PARTIAL"]

#: what to do about a batch the plan cannot take: both keep every other batch as it is
FIX_PARTIAL = ("drop the last, partial batch (DataLoader(..., drop_last=True)), or pad it to {rows} rows per dp rank "
               "with rows whose labels are ignored (-100 in the labels or target) so they count for nothing")


def batch_rows(tensors: tuple, names: tuple[str, ...], *, local: int, where: str) -> int:
    """The rows (dim 0) every tensor of this rank's batch holds; PlanError/InputError when they cannot be run."""
    rows = {}
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            got = "a 0-dim tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"batch input {name!r} is {got}: every input carries the batch on dim 0", where=where,
                             fix="pass this rank's dp slice of each input, rows on dim 0 "
                                 "(program.shard_batch(global_batch) cuts every input of a global batch)")
        rows[name] = int(t.shape[0])
    if len(set(rows.values())) > 1:
        listed = ", ".join(f"{k} {v}" for k, v in rows.items())
        raise InputError(f"the batch's inputs disagree on their rows (dim 0): {listed}", where=where,
                         fix="pass the same rows of every input (program.shard_batch(global_batch) cuts them together)")
    n = next(iter(rows.values()))
    if n > local:
        raise PlanError(f"this rank's batch has {n} rows, more than the {local} the program was compiled for",
                        where=where, fix=f"compile on the largest batch you will pass (a smaller one trains as well: "
                                         f"fewer or smaller microbatches), or pass at most {local} rows per dp rank "
                                         "(program.shard_batch(global_batch) cuts a global batch over dp)")
    if n == 0:
        raise PlanError("this rank's batch has no rows: a batch smaller than dp leaves some dp ranks none",
                        where=where, fix=FIX_PARTIAL.format(rows=local))
    return n


def microbatch_rows(rows: int, *, size: int, count: int, takes: Callable[[int], bool]) -> list[int]:
    """The rows of each microbatch of a ``rows``-row batch (module docstring); PlanError when none fits."""
    if rows == size * count:
        return [size] * count
    k = -(-rows // size)
    if takes(k):
        return [size] * (k - 1) + [rows - size * (k - 1)]
    if rows >= count and takes(count):
        return [len(c) for c in torch.arange(rows, device="cpu").tensor_split(count)]
    raise PlanError(f"a batch of {rows} rows makes {k} microbatches of at most {size} rows, fewer than the schedule "
                    f"runs (it needs {count}, one row each at least)", where="this rank's batch",
                    fix=FIX_PARTIAL.format(rows=size * count))


def cut_rows(tensors: tuple, names: tuple[str, ...], sizes: list[int]) -> list[dict]:
    """The microbatches: ``{name: rows}`` of each, in order."""
    pieces = [t.split(sizes, dim=0) for t in tensors]
    return [{name: p[i] for name, p in zip(names, pieces)} for i in range(len(sizes))]
