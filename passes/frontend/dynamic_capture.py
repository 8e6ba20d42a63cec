"""Capture with symbolic dims: which batch dims to mark, export's ``dynamic_shapes``, and what stayed symbolic.

``torch.export`` (``Dim.AUTO``) keeps a marked dim symbolic where the model's code allows it: the
graph then reads the size with ``aten.sym_size`` and one graph runs every length. Where the code
fixes the size (an equality guard, a size-1 dim) export specialises it silently; :func:`read_dynamic_dims`
reads back which marked dims stayed symbolic, their symbol, the inputs that share it and the range
export proved (``exported.range_constraints``: a position buffer sliced by the length bounds it).

:func:`sequence_dims` is the default marking: dim 1 (the sequence) of every batch input, target
included, whose dim 1 matches the first integer input's (token ids, masks and labels of a collator's
batch). Image batches and other float-only inputs mark nothing.

Example::

    >>> ids = torch.zeros(4, 16, dtype=torch.long)
    >>> sequence_dims((ids, torch.ones(4, 16)), target=ids)
    {0: (1,), 1: (1,), 2: (1,)}
    >>> sequence_dims((torch.randn(4, 3, 8, 8),)) == {}
    True
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from autopar.ir.dynamic_shapes import DynamicDim

__all__ = ["sequence_dims", "export_dynamic_shapes", "read_dynamic_dims", "export_ranges"]


def _is_integer(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex


def sequence_dims(inputs: tuple, target=None) -> dict[int, tuple[int, ...]]:
    """{position in inputs + (target,): (1,)} for the inputs whose dim 1 is the batch's sequence."""
    args = tuple(inputs) + ((target,) if target is not None else ())
    tokens = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2 and _is_integer(a)), None)
    if tokens is None or tokens.shape[1] < 2:  # export specialises a size-1 dim anyway
        return {}
    seq = tokens.shape[1]
    return {i: (1,) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[1] == seq}


def export_dynamic_shapes(num_args: int, marks: Mapping[int, tuple[int, ...]]):
    """``dynamic_shapes`` for a root whose forward takes ``*args``: ``Dim.AUTO`` on each marked dim."""
    specs = tuple({d: torch.export.Dim.AUTO for d in marks[i]} if marks.get(i) else None for i in range(num_args))
    return (specs,)


def _finite(value) -> int | None:
    """A sympy bound as an int; None for an infinite one (``int_oo``)."""
    return int(value) if getattr(value, "is_Integer", False) else None


def export_ranges(exported) -> dict[str, tuple[int, int | None]]:
    """{symbol: (low, high or None)} of an ExportedProgram's range constraints."""
    return {str(symbol): (_finite(bounds.lower) or 0, _finite(bounds.upper))
            for symbol, bounds in exported.range_constraints.items()}


def read_dynamic_dims(gm: fx.GraphModule, ranges: Mapping[str, tuple[int, int | None]]) -> tuple[DynamicDim, ...]:
    """The dims of ``gm``'s inputs that stayed symbolic, one :class:`DynamicDim` per symbol (graph order)."""
    found: dict[str, list[tuple[str, int]]] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if isinstance(size, torch.SymInt) and expr is not None and expr.is_Symbol:
                found.setdefault(str(expr), []).append((node.name, dim))
    dims = []
    for symbol, inputs in found.items():
        low, high = ranges.get(symbol, (2, None))
        dims.append(DynamicDim(symbol=symbol, inputs=tuple(inputs), low=max(low, 1), high=high,
                               bound_source="the model's code (export's range)" if high is not None else ""))
    return tuple(dims)

