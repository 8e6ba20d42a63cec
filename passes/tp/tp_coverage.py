"""Say what tensor parallelism leaves replicated because no rule covers its op.

:func:`autopar.passes.tp.tp_regions.find_tp_regions` nominates projections (``aten.linear``, and
``addmm``/``mm``/``matmul`` with a 2-D parameter, transposed or stored (in, out) as transformers'
``Conv1D`` does) and warns about each candidate it cannot shard. A weight used by another op
(``bmm``, ``einsum``, a grouped convolution) is never a candidate, so without this pass it would stay
replicated silently. :func:`warn_unsharded_matmuls` logs one
warning per such node, naming the module, the node and why.

Example::

    >>> import logging, torch, torch.nn as nn
    >>> from autopar.passes.frontend.capture import capture
    >>> class Experts(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.randn(3, 4, 8))
    ...     def forward(self, x):
    ...         return torch.bmm(x, self.weight)
    >>> gm = capture(Experts(), (torch.randn(3, 2, 4),)).gm
    >>> [n.name for n in unsharded_matmuls(gm)]
    ['bmm']
"""
from __future__ import annotations

import logging

import torch.fx as fx

__all__ = ["unsharded_matmuls", "warn_unsharded_matmuls"]

log = logging.getLogger("autopar.passes.tp.tp_regions")  # next to the region finder's own warnings

_MATMULS = ("addmm", "mm", "matmul", "bmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d", "convolution")


def _op(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _reads_parameter(node: fx.Node) -> bool:
    return any(a.op == "get_attr" for a in node.all_input_nodes)


def unsharded_matmuls(gm: fx.GraphModule) -> list[fx.Node]:
    """Matrix products and convolutions with a weight read by get_attr that are not projections.

    Projections (:func:`autopar.passes.tp.tp_regions.projection_of`: ``linear``, ``addmm``/``mm``/
    ``matmul`` with a parameter) are the region finder's candidates, which warns about those it leaves.
    """
    from autopar.passes.tp.tp_gather_output import conv_of
    from autopar.passes.tp.tp_regions import projection_of
    return [n for n in gm.graph.nodes if n.op == "call_function" and _op(n) in _MATMULS and _reads_parameter(n)
            and projection_of(n) is None and conv_of(n) is None]


def _path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else "<root>"


def _why(op: str) -> str:
    if op.startswith("conv"):
        return "this convolution (grouped, transposed, or its weight read elsewhere) has no tensor-parallel rule"
    return (f"aten.{op} with this weight operand has no tensor-parallel rule (projections with a 2-D "
            "parameter weight are sharded: linear, addmm, mm, matmul)")


def warn_unsharded_matmuls(gm: fx.GraphModule) -> list[fx.Node]:
    """Log a warning for each weight product tensor parallelism cannot shard; returns the nodes."""
    nodes = unsharded_matmuls(gm)
    for node in nodes:
        log.warning("tensor parallel: %s (node %s) stays replicated: %s", _path(node), node.name, _why(_op(node)))
    return nodes
