"""The sizes of a graph's tensors as functions of its symbolic input dims, fit from runs at other sizes.

A graph captured with dynamic dims (:mod:`autopar.passes.frontend.dynamic_capture`) runs any size of them,
but what crosses a pipeline edge must be received into a buffer of the right shape before the
receiving stage runs. :func:`symbolic_shapes` finds, for every tensor of the graph, each dim as an
integer polynomial of the symbols that is multilinear (``rows * seq * hidden`` of a flattened
activation; ``seq`` of a ``[rows, heads, seq, seq]`` mask): the graph is run on fake tensors at
the corners of a box of sizes (each symbol at its example value and one other), the coefficients
solved exactly (sympy) and checked at one more point. Propagating on fake tensors with sympy
symbols would give the same answer at several times the cost (torch's ShapeEnv on every op).

A graph whose sizes are not such polynomials (a size that halves the length, a pad to a multiple)
raises :class:`NotMultilinear`; the lowering then compiles that length alone (docs/batches.md).

Example::

    >>> import torch
    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> from autopar.passes.frontend.annotate import annotate_tensors
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> c = capture(model, (x,), loss_fn=loss_fn, example_target=y, dynamic={0: (1,), 1: (1,)})
    >>> gm = annotate_tensors(c.gm, example_inputs=(x, y))
    >>> shapes = symbolic_shapes(gm, (x, y), c.dynamic)
    >>> rows, seq, hidden = shapes["add"]      # the embedding sum
    >>> rows, str(seq) == c.dynamic[0].symbol, hidden
    (8, True, 32)
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import sympy
import torch
import torch.fx as fx

from autopar.errors import PassError
from autopar.ir.dynamic_shapes import DynamicDim, SizeExpr
from autopar.passes.frontend.shape_prop import run_on_meta

__all__ = ["symbolic_shapes", "probe_inputs", "probe_value", "NotMultilinear"]

_MAX_SYMBOLS = 3  # 2^k + 1 runs of the graph


class NotMultilinear(PassError):
    """A tensor size of the graph is no multilinear integer polynomial of its symbolic dims."""


def probe_value(dim: DynamicDim, value: int, *, shift: int = 1) -> int:
    """Another size of ``dim`` the graph takes: ``shift`` steps (of its multiple) below ``value``, else above."""
    step = dim.multiple_of * shift
    if value - step >= max(dim.low, 2):
        return value - step
    return value + step


def probe_inputs(example_inputs: tuple, names: tuple[str, ...], dims: tuple[DynamicDim, ...],
                 sizes: Mapping[str, int]) -> tuple:
    """Meta tensors shaped as ``example_inputs`` with each dynamic dim at ``sizes[symbol]``."""
    where = {(name, axis): d.symbol for d in dims for name, axis in d.inputs}
    out = []
    for name, value in zip(names, example_inputs):
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        shape = [sizes.get(where.get((name, axis)), size) for axis, size in enumerate(value.shape)]
        out.append(torch.empty(shape, dtype=value.dtype, device="meta"))
    return tuple(out)


def _shapes_at(gm: fx.GraphModule, inputs: tuple) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}

    def record(node: fx.Node, value, _flops) -> None:
        if isinstance(value, torch.Tensor):
            shapes[node.name] = tuple(value.shape)

    run_on_meta(gm, inputs, record)
    return shapes


def _solve(points: list[tuple[dict, int]], symbols: list[str]) -> SizeExpr | int:
    """The multilinear polynomial through ``points`` ([({symbol: value}, size)]), integer coefficients."""
    subsets = [c for k in range(len(symbols) + 1) for c in itertools.combinations(symbols, k)]
    matrix = sympy.Matrix([[sympy.prod([at[s] for s in subset]) for subset in subsets] for at, _ in points])
    solution = matrix.LUsolve(sympy.Matrix([size for _, size in points]))
    terms = []
    for subset, value in zip(subsets, solution):
        if not value.is_integer:
            raise NotMultilinear(f"a size takes the values {[p[1] for p in points]} at "
                                 f"{[p[0] for p in points]}: not an integer polynomial of {symbols}")
        if value:
            terms.append((int(value), subset))
    if all(not subset for _, subset in terms):
        return sum(c for c, _ in terms)
    return SizeExpr(tuple(terms))


def symbolic_shapes(gm: fx.GraphModule, example_inputs: tuple, dims: tuple[DynamicDim, ...],
                    nodes=None) -> dict[str, tuple]:
    """{node name: shape} of every tensor node (of ``nodes``, names, when given), each symbolic dim a
    :class:`SizeExpr` (ints elsewhere).

    ``example_inputs``: the graph's inputs at the example sizes (``gm``'s placeholders, in order).
    """
    if not dims:
        return {}
    if len(dims) > _MAX_SYMBOLS:
        raise NotMultilinear(f"{len(dims)} symbolic dims: at most {_MAX_SYMBOLS} are fit")
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    base = {}
    for d in dims:
        name, axis = d.inputs[0]
        base[d.symbol] = int(example_inputs[names.index(name)].shape[axis])
    symbols = [d.symbol for d in dims]
    other = {d.symbol: probe_value(d, base[d.symbol]) for d in dims}
    corners = [{s: (other[s] if flip else base[s]) for s, flip in zip(symbols, flips)}
               for flips in itertools.product((False, True), repeat=len(dims))]
    check = {d.symbol: probe_value(d, base[d.symbol], shift=2) for d in dims}
    runs = [(at, _shapes_at(gm, probe_inputs(example_inputs, names, dims, at))) for at in corners + [check]]
    out = {}
    wanted = None if nodes is None else set(nodes)
    for node, shape in runs[0][1].items():
        if wanted is not None and node not in wanted:
            continue
        if all(r[1].get(node) == shape for r in runs):
            out[node] = shape
            continue
        if any(len(r[1].get(node, ())) != len(shape) for r in runs):
            raise NotMultilinear(f"node {node} changes rank with the symbolic dims")
        fitted = []
        for axis in range(len(shape)):
            values = [(at, r[node][axis]) for at, r in runs]
            if len({v for _, v in values}) == 1:
                fitted.append(shape[axis])
                continue
            expr = _solve(values[:-1], symbols)
            at, size = values[-1]
            if (expr(at) if isinstance(expr, SizeExpr) else expr) != size:
                raise NotMultilinear(f"dim {axis} of node {node} is {size} at {at}, not {expr} as fit")
            fitted.append(expr)
        out[node] = tuple(fitted)
    return out
