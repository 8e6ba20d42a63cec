"""Projections: ``x @ W^T (+ b)`` with ``W`` a parameter, however the op spells it.

The tensor-parallel candidates of :mod:`autopar.passes.tp.tp_regions`: ``aten.linear``, ``addmm``/``mm``/
``matmul`` with a weight stored (in, out) (transformers' ``Conv1D``) or read through a transpose
(Falcon's ``x @ W.T``), and how many equal blocks a fused projection's output holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.ir.meta_keys import PARAM, get_meta
from autopar.passes.tp.tp_rules import op_name, shape_of

__all__ = ["Projection", "is_param_linear", "projection_of", "seed_chunks"]


@dataclass(frozen=True)
class Projection:
    """``x @ W^T (+ b)`` with ``W`` a parameter, however the op spells it.

    ``out_dim`` is the weight dim that indexes output features: 0 for ``aten.linear`` and a weight
    read through ``t`` (Falcon's ``x @ W.T``), 1 for a weight stored (in, out) (``addmm``/``mm``/
    ``matmul``, transformers' ``Conv1D``). ``via`` is the transpose node between parameter and op.
    """

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out_dim: int
    via: fx.Node | None = None


def _param_read(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    info = get_meta(node, PARAM)
    return info is not None and info.is_parameter and len(node.users) == 1 and len(info.aliases) == 1


def _weight(w) -> tuple[fx.Node, fx.Node | None, bool] | None:
    """(parameter, transpose node, transposed?) of a 2-D weight operand, or None."""
    if _param_read(w):
        return (w, None, False) if len(shape_of(w)) == 2 else None
    if (isinstance(w, fx.Node) and w.op == "call_function" and len(w.users) == 1 and _param_read(w.args[0])
            and len(shape_of(w.args[0])) == 2):
        name = op_name(w)
        if name in ("t", "numpy_T") or (name == "transpose" and sorted(d % 2 for d in w.args[1:3]) == [0, 1]) or (
                name == "permute" and [d % 2 for d in w.args[1]] == [1, 0]):
            return w.args[0], w, True
    return None


def projection_of(node: fx.Node) -> Projection | None:
    """The projection ``node`` computes, or None (see :class:`Projection`)."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    if name == "linear" and _param_read(node.args[1]) and isinstance(node.args[0], fx.Node):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None and not _param_read(bias):
            return None
        return Projection(node, node.args[0], node.args[1], bias, 0)
    if name in ("addmm", "mm", "matmul") and not node.kwargs:
        x, w = (node.args[1], node.args[2]) if name == "addmm" else node.args[:2]
        found = _weight(w)
        bias = node.args[0] if name == "addmm" else None
        if found is None or not isinstance(x, fx.Node) or (bias is not None and not (
                _param_read(bias) and len(shape_of(bias)) == 1)):
            return None
        weight, via, transposed = found
        return Projection(node, x, weight, bias, 0 if transposed else 1, via)
    return None


def is_param_linear(node: fx.Node) -> bool:
    """A projection (:func:`projection_of`): ``aten.linear``, ``addmm``, ``mm`` or ``matmul`` with a parameter."""
    return projection_of(node) is not None


def seed_chunks(linear: fx.Node) -> int:
    """How many equal blocks a column output holds (a fused qkv split three ways -> 3).

    Looks through views that keep the feature dim last (``Conv1D``'s ``addmm`` output is viewed
    back to (batch, seq, features) before its split).
    """
    out_rank = len(shape_of(linear))
    size = shape_of(linear)[-1]
    for user in linear.users:
        if user.op != "call_function":
            continue
        name = op_name(user)
        if name in ("view", "reshape", "_unsafe_view") and shape_of(user) and shape_of(user)[-1] == size:
            found = seed_chunks(user)
            if found > 1:
                return found
        if name in ("split", "split_with_sizes", "chunk"):
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % out_rank == out_rank - 1:
                arg = user.args[1]
                return len(arg) if isinstance(arg, (list, tuple)) else (arg if name == "chunk"
                                                                        else -(-size // arg))
    return 1
