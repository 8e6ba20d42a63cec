"""Refuse ops whose output shape depends on the data: autopar plans with static shapes.

Every pass after capture (shape propagation, costs, sharding, stage cuts, send/recv buffers) needs
each tensor's shape to follow from the input shapes. ``torch.unique``, ``torch.nonzero``,
``masked_select`` and indexing with a boolean mask produce as many elements as the data says, so
:func:`check_static_shapes` raises :class:`autopar.CaptureError` naming the op, the node and the
user's source line, and says what to write instead.

Example::

    >>> import torch, torch.nn as nn
    >>> from autopar.passes.frontend.capture import capture
    >>> class Dedup(nn.Module):
    ...     def forward(self, x):
    ...         return torch.unique(x)
    >>> gm = capture(Dedup(), (torch.randn(4),)).gm
    >>> [n.name for n in dynamic_shape_nodes(gm)]
    ['_unique2']
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from autopar.errors import CaptureError
from autopar.passes.lowering_state import LoweringState

__all__ = ["dynamic_shape_nodes", "check_static_shapes"]

_MASK_INDEXING = ("index.Tensor", "index_put")


def _is_bool(node) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _dynamic(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if any(name in str(node.target) for name in _MASK_INDEXING):  # integer indices keep shapes static
        indices = node.args[1] if len(node.args) > 1 else ()
        return any(_is_bool(i) for i in (indices or ()))
    return True


def dynamic_shape_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Call nodes whose output shape depends on the values of their inputs."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and _dynamic(n)]


def _source_line(node: fx.Node) -> str | None:
    """The innermost ``File …, line …`` of the node's stack trace outside torch and autopar's capture."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', node.meta.get("stack_trace") or "")
    user = [f for f in frames if "/torch/" not in f[0] and not f[0].endswith("passes/frontend/capture.py")]
    if not user:
        return None
    path, line, func, code = user[-1]
    return f"{path}:{line} in {func}: {code.strip()}"


def check_static_shapes(st: LoweringState) -> LoweringState:
    """A check pass: CaptureError at the first op of ``st.gm`` whose output shape depends on the data."""
    nodes = dynamic_shape_nodes(st.gm)
    if not nodes:
        return st
    node = nodes[0]
    op = str(node.target).removeprefix("aten.")
    source = _source_line(node)
    raise CaptureError(
        f"op {op} (node {node.name}) makes a tensor whose shape depends on the data; autopar plans "
        f"stages, shards and transfers from static shapes",
        where=source or f"node {node.name}",
        fix="compute a fixed-shape result instead: a mask with torch.where instead of boolean indexing, "
            "nonzero or masked_select; a fixed-size buffer (and a count) instead of torch.unique")
