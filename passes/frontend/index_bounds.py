"""Index bounds: which graph inputs index a table (an embedding, a position table), and how far.

Fake tensors do not check indices, so a token id past the embedding's rows or a sequence longer
than the position table passes capture and planning and fails only on the real run, inside one
rank's stage. This analysis finds every *lookup* (``aten.embedding``; ``index_select`` or
indexing of a parameter or buffer) and follows its index back through ops that keep values
(views, reshapes, copies, dtype casts, slices):

- to a graph input: the input's placeholder gets ``autopar.index_bound`` (:class:`IndexBound`,
  the rows it may index and the lookups), which the runtime checks every step on the rank that
  holds the input (:mod:`autopar.runtime.execution.index_guard`);
- to constants only (``arange(seq)`` of a position table): the index is computed now, once
  (:func:`constant_index_problems`), so a sequence longer than the table is a plan-time error.
  A graph with a symbolic sequence dim computes ``arange(sym_size(ids, 1))``: the size is taken at
  the example's value, and :func:`position_limit` finds the longest sequence whose positions stay
  inside the table (the bound a batch is checked against, docs/batches.md).

An index computed from an input by arithmetic (``cumsum`` of a mask) is not followed: it is
neither bounded here nor checked at run time.

Example (``gm`` captured from ``gpt_tiny``)::

    annotate_index_bounds(gm)   # {'idx': IndexBound(rows=128, lookups=('tok_emb (embedding, 128 rows)',))}
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.ir.graph_names import MODEL_PREFIX
from autopar.ir.meta_keys import INDEX_BOUND, MODULE, PARAM, TENSOR, IndexBound, get_meta, range_text, set_meta

__all__ = ["Lookup", "find_lookups", "annotate_index_bounds", "constant_index_problems", "index_problem",
           "position_limit"]

# ops whose output holds (a selection of) their first argument's values unchanged
_KEEP_VALUES = frozenset({
    "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "clone", "contiguous", "alias",
    "detach", "_to_copy", "to", "slice", "select", "flatten", "permute", "transpose", "t", "lift_fresh_copy",
    "repeat", "expand_as", "view_as", "type_as",
})
_MAX_CONSTANT_NODES = 64  # a constant index computed by more ops than this is not evaluated


def _op(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    parts = str(node.target).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else getattr(node.target, "__name__", None)


def _rows(node) -> tuple[int, ...] | None:
    info = get_meta(node, TENSOR) if isinstance(node, fx.Node) else None
    return info.shape if info is not None else None


def _from_table(node: fx.Node) -> bool:
    """Does ``node`` hold a parameter's or buffer's values (a get_attr seen through value-keeping ops)?"""
    while _op(node) in _KEEP_VALUES and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op == "get_attr"


class Lookup:
    """One table lookup: the index node, the table's rows and a readable name."""

    def __init__(self, node: fx.Node, index: fx.Node, rows: int, *, wraps: bool = False):
        self.node, self.index, self.rows = node, index, rows
        self.low = -rows if wraps else 0  # tensor indexing reads -1 as the last row; embedding does not
        info = get_meta(node, MODULE)
        path = info.path if info is not None else ""
        path = "" if path == MODEL_PREFIX else path.removeprefix(MODEL_PREFIX + ".")  # as the user names it
        self.name = f"{path or '<root>'} ({node.name}, {rows} rows)"


def find_lookups(gm: fx.GraphModule) -> list[Lookup]:
    """Every embedding, and every index_select/indexing of a parameter or buffer, with its table's rows."""
    found = []
    for node in gm.graph.nodes:
        op = _op(node)
        if op == "embedding" and len(node.args) >= 2:
            table, index, dim = node.args[0], node.args[1], 0
        elif op == "index_select" and len(node.args) >= 3 and _from_table(node.args[0]):
            table, dim, index = node.args[0], node.args[1], node.args[2]
        elif op == "index" and len(node.args) >= 2 and _from_table(node.args[0]):
            positions = [i for i, a in enumerate(node.args[1]) if isinstance(a, fx.Node)]
            if not positions:
                continue
            table, dim, index = node.args[0], positions[0], node.args[1][positions[0]]
        else:
            continue
        shape = _rows(table)
        if not isinstance(index, fx.Node) or not shape or not isinstance(dim, int):
            continue
        if not -len(shape) <= dim < len(shape):
            continue
        info = get_meta(index, TENSOR)
        if info is None or info.dtype is None or info.dtype.is_floating_point or info.dtype == torch.bool:
            continue  # a boolean mask selects, it does not index
        found.append(Lookup(node, index, shape[dim], wraps=op == "index"))
    return found


def _source(index: fx.Node) -> fx.Node:
    while _op(index) in _KEEP_VALUES and index.args and isinstance(index.args[0], fx.Node):
        index = index.args[0]
    return index


def annotate_index_bounds(gm: fx.GraphModule) -> dict[str, IndexBound]:
    """Write ``autopar.index_bound`` on every input that indexes a table; returns {input: bound}."""
    per_input: dict[fx.Node, list[Lookup]] = {}
    for lookup in find_lookups(gm):
        source = _source(lookup.index)
        if source.op == "placeholder":
            per_input.setdefault(source, []).append(lookup)
    bounds = {}
    for node, lookups in per_input.items():
        lookups = sorted(lookups, key=lambda lk: lk.rows)  # the smallest table bounds the input
        bounds[node.name] = IndexBound(rows=lookups[0].rows, lookups=tuple(lk.name for lk in lookups),
                                       low=max(lk.low for lk in lookups))
        set_meta(node, INDEX_BOUND, bounds[node.name])
    return bounds


def _is_size(node: fx.Node) -> bool:
    """``aten.sym_size(input, dim)``: a symbolic dim's size, known at the example's value."""
    return (node.op == "call_function" and node.target is torch.ops.aten.sym_size.int
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder")


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """The nodes ``node`` is computed from, in graph order; None if an input or a parameter is among them
    (an input's symbolic size is not: it ends the walk)."""
    seen, todo = {node}, [node]
    while todo:
        current = todo.pop()
        if _is_size(current):
            continue
        for a in current.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    if len(seen) > _MAX_CONSTANT_NODES:
        return None
    for n in seen:
        param = get_meta(n, PARAM) if n.op == "get_attr" else None
        if n.op == "placeholder" or (param is not None and param.is_parameter) or n.op not in (
                "get_attr", "call_function"):
            return None
    return [n for n in node.graph.nodes if n in seen]


def _example_size(node: fx.Node) -> int:
    info = get_meta(node.args[0], TENSOR)
    return int(info.shape[node.args[1]])


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node], sizes=None):
    """The last node's value, computed from ``nodes``; a symbolic size at ``sizes[node]`` or the example's."""
    env: dict[fx.Node, object] = {}
    for n in nodes:
        if n.op == "get_attr":
            value = gm
            for part in n.target.split("."):
                value = getattr(value, part)
        elif _is_size(n):
            value = (sizes or {}).get(n, _example_size(n))
        else:
            value = n.target(*fx.map_arg(n.args, env.__getitem__), **fx.map_arg(n.kwargs, env.__getitem__))
        if isinstance(value, torch.Tensor) and value.is_meta:
            return None
        env[n] = value
    return env[nodes[-1]]


def index_problem(values: torch.Tensor, rows: int, low: int = 0) -> str | None:
    """'holds values 0..40, outside the table's rows 0..31' when ``values`` leave the table, else None."""
    if values.numel() == 0:
        return None
    least, most = int(values.min()), int(values.max())
    if low <= least and most < rows:
        return None
    return f"holds values {least}..{most}, outside the table's {range_text(low, rows)}"


def constant_index_problems(gm: fx.GraphModule) -> list[tuple[Lookup, str]]:
    """Lookups whose index is computed from constants only (a position table's ``arange``) and leaves the table."""
    problems = []
    for lookup in find_lookups(gm):
        nodes = _ancestors(lookup.index)
        if nodes is None or any("rand" in str(n.target) for n in nodes):
            continue
        try:
            value = _evaluate(gm, nodes)
        except Exception:  # noqa: BLE001 - an index we cannot compute here is left to the run
            continue
        if isinstance(value, torch.Tensor):
            problem = index_problem(value, lookup.rows, lookup.low)
            if problem:
                problems.append((lookup, problem))
    return problems


_SEARCH_LIMIT = 1 << 20  # the longest sequence a position table is searched for


def _fits(gm, lookup: Lookup, nodes, size_node, length: int) -> bool:
    try:
        value = _evaluate(gm, nodes, {size_node: length})
    except Exception:  # noqa: BLE001 - an index that cannot be computed at this length does not fit
        return False
    return isinstance(value, torch.Tensor) and index_problem(value, lookup.rows, lookup.low) is None


def position_limit(gm: fx.GraphModule, inputs: set[tuple[str, int]]) -> tuple[int, str] | None:
    """(the longest size of the symbolic dim carried by ``inputs`` ({(input, dim)}) whose computed
    positions stay inside every table they index, the smallest such table's name), or None."""
    best = None
    for lookup in find_lookups(gm):
        nodes = _ancestors(lookup.index)
        sizes = [n for n in nodes or () if _is_size(n)]
        if not sizes or any((n.args[0].name, n.args[1]) not in inputs for n in sizes) or len(sizes) != 1:
            continue
        low = _example_size(sizes[0])
        if not _fits(gm, lookup, nodes, sizes[0], low):
            continue  # already past the table at the example: constant_index_problems reports it
        high = low
        while high < _SEARCH_LIMIT and _fits(gm, lookup, nodes, sizes[0], high * 2):
            high *= 2
        top = high * 2  # low..high fit, top does not (or is past the search)
        while top - high > 1:
            middle = (high + top) // 2
            high, top = (middle, top) if _fits(gm, lookup, nodes, sizes[0], middle) else (high, middle)
        if high < _SEARCH_LIMIT and (best is None or high < best[0]):
            best = (high, f"the position table {lookup.name}")
    return best
