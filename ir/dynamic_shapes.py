"""Dims of the batch that change from step to step: which inputs carry them, their range, and sizes made of them.

A graph captured with a *dynamic* dim (``torch.export`` with ``Dim.AUTO``, :mod:`autopar.passes.frontend.capture`)
reads that dim's size at run time (``aten.sym_size``) instead of a number baked into its views, so one
graph runs every sequence length. :class:`DynamicDim` records one such dim: its symbol (the name
export gave it), the inputs and tensor dims that carry it, the range a batch may take (``low`` from
export, ``high`` the bound: the model's own maximum or the user's ``max_seq_len``) and the multiple
the plan needs (``tp`` under sequence parallelism). :class:`SizeExpr` is a size written in those
symbols (a pipeline edge's ``[rows, seq, hidden]``), evaluated per microbatch by the pipeline's
send and recv nodes (:mod:`autopar.ops.p2p`).

Example::

    >>> seq = DynamicDim(symbol="s0", inputs=(("input_ids", 1), ("labels", 1)), low=2, high=64)
    >>> sizes = batch_sizes((seq,), {"input_ids": torch.zeros(4, 17), "labels": torch.zeros(4, 17)})
    >>> sizes
    {'s0': 17}
    >>> resolve_shape((4, SizeExpr.of(("s0",), 1), 32), sizes)
    (4, 17, 32)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["DynamicDim", "SizeExpr", "batch_sizes", "resolve_shape", "is_symbolic", "dim_label"]

DIM_LABELS = {0: "rows", 1: "seq"}  # what a person calls dim 0 and dim 1 of a batch input


def dim_label(dim: int) -> str:
    """'seq' for dim 1, 'rows' for dim 0, else 'dim d'."""
    return DIM_LABELS.get(dim, f"dim {dim}")


@dataclass(frozen=True)
class DynamicDim:
    """One symbolic dim of the batch: ``inputs`` are the (input name, tensor dim) pairs that carry it."""

    symbol: str
    inputs: tuple[tuple[str, int], ...]
    low: int = 2
    high: int | None = None  # the bound: a batch past it is refused (None: no bound known)
    multiple_of: int = 1  # a size the plan needs it to divide by (sequence parallelism: tp)
    bound_source: str = ""  # where ``high`` comes from, for messages ("the model's max_position_embeddings")

    @property
    def label(self) -> str:
        """What a person calls it: 'seq' (dim 1 of the inputs), 'rows' (dim 0)."""
        return dim_label(self.inputs[0][1])

    def describe(self) -> str:
        """'seq (dim 1 of input_ids, attention_mask, labels): 2..64 (the model's max_position_embeddings)'."""
        where = ", ".join(name for name, _ in self.inputs)
        high = "no bound" if self.high is None else str(self.high)
        extra = f", a multiple of {self.multiple_of}" if self.multiple_of > 1 else ""
        source = f" ({self.bound_source})" if self.bound_source and self.high is not None else ""
        return f"{self.label} (dim {self.inputs[0][1]} of {where}): {self.low}..{high}{source}{extra}"


@dataclass(frozen=True)
class SizeExpr:
    """A size as an integer polynomial in the symbols: ``sum(coefficient * product(symbols))``.

    ``terms``: ((coefficient, (symbol, ...)), ...); the empty tuple of symbols is the constant.
    """

    terms: tuple[tuple[int, tuple[str, ...]], ...]

    @classmethod
    def of(cls, symbols: tuple[str, ...], coefficient: int = 1, constant: int = 0) -> "SizeExpr":
        terms = ((coefficient, tuple(symbols)),) + (((constant, ()),) if constant else ())
        return cls(terms)

    def __call__(self, sizes: Mapping[str, int]) -> int:
        total = 0
        for coefficient, symbols in self.terms:
            term = coefficient
            for s in symbols:
                term *= sizes[s]
            total += term
        return total

    def __str__(self) -> str:
        parts = [("*".join(((str(c),) if c != 1 or not s else ()) + s) or "1") for c, s in self.terms if c]
        return " + ".join(parts) or "0"


def is_symbolic(shape) -> bool:
    """Whether a shape holds a :class:`SizeExpr`."""
    return any(isinstance(d, SizeExpr) for d in shape)


def resolve_shape(shape, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape: each :class:`SizeExpr` evaluated at ``sizes``, ints as they are."""
    return tuple(d(sizes) if isinstance(d, SizeExpr) else d for d in shape)


def batch_sizes(dims: tuple[DynamicDim, ...], batch: Mapping[str, object]) -> dict[str, int]:
    """{symbol: size} of one microbatch: each dim read off the first of its inputs the batch holds."""
    sizes = {}
    for d in dims:
        for name, axis in d.inputs:
            value = batch.get(name)
            if isinstance(value, torch.Tensor):
                sizes[d.symbol] = int(value.shape[axis])
                break
    return sizes
