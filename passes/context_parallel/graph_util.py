"""Small readers of a captured ATen graph that the context-parallel analyses share.

Example::

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> y = g.call_function(torch.ops.aten.softmax.int, (x, -1))
    >>> op_key(y), is_op(y, "softmax"), ancestors([y]) == {x, y}
    ('softmax.int', True, True)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["op_key", "is_op", "value", "shape", "ancestors", "descendants", "param_of", "scalar"]


def op_key(node) -> str:
    """``aten.softmax.int`` -> ``softmax.int``; ``getitem`` for ``operator.getitem``; '' for a non-call."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    name = str(node.target)
    return name.split(".", 1)[1] if name.startswith("aten.") else name


def is_op(node, *families: str) -> bool:
    """Whether ``node`` calls an op of one of ``families`` (the name before the overload: ``softmax``)."""
    return op_key(node).split(".")[0] in families


def value(node):
    """The example value export recorded for ``node`` (a fake tensor), or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node) -> tuple | None:
    val = value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _reach(start, step) -> set:
    seen, todo = set(), list(start)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(step(node))
    return seen


def ancestors(start) -> set:
    """``start`` and every node they read, directly or not."""
    return _reach(start, lambda n: n.all_input_nodes)


def descendants(start) -> set:
    """``start`` and every node that reads them, directly or not."""
    return _reach(start, lambda n: n.users)


def param_of(gm: fx.GraphModule, node) -> torch.nn.Parameter | None:
    """The parameter a ``get_attr`` node reads (None for a buffer, a constant or another node)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.nn.Parameter) else None


def scalar(arg) -> float | None:
    """A Python number argument (or a 0-d constant tensor export lifted) as a float; None otherwise."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    return None
