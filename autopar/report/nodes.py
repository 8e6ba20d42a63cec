"""What one graph node is, in words: the shared vocabulary of the HTML report and the text diff.

:func:`describe_node` reads a node of a rewritten graph and its ``autopar.*`` metadata and returns a
:class:`NodeView`: its kind (input, parameter, compute, collective, send/recv, recompute region,
output), a one-line normalised form (``view = aten.view(getitem, [1, 32, 2, 8])``), its shape, its
tensor-parallel placement and its stage. :func:`walk` visits a graph's nodes in order, descending
into recompute regions so that the collectives inside them are seen too.

    >>> import torch.fx as fx, torch.nn as nn
    >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    >>> [describe_node(gm, n).kind for n, _gm, _depth in walk(gm)]
    ['input', 'compute', 'output']
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir.meta_keys import MODULE, PARAM, STAGE, TENSOR, TP_PLACEMENT, get_meta
from autopar.ops.collectives import GraphCollective
from autopar.ops.p2p import RecvActivation, SendActivation

__all__ = ["NodeView", "describe_node", "walk", "format_arg", "KINDS"]

# every kind a node can have, in the order the legend lists them
KINDS = ("input", "param", "compute", "collective", "send", "recv", "region", "output")


@dataclass(frozen=True)
class NodeView:
    """A node as the report shows it.

    ``kind``: one of :data:`KINDS`. ``op``: what it runs (``aten.view``, ``TpCopy``, a parameter's
    name). ``line``: ``name = op(args)`` with values named by their node. ``comm``: for a
    collective, what it communicates and over which mesh axis; for send/recv, the peer stage.
    """

    name: str
    kind: str
    op: str
    line: str
    shape: tuple | None
    dtype: str
    placement: str
    stage: int | None
    module: str
    comm: str = ""


def format_arg(arg) -> str:
    """An argument as source-like text: nodes by name, lists and tuples element-wise."""
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(format_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k}: {format_arg(v)}" for k, v in arg.items()) + "}"
    if isinstance(arg, torch.dtype):
        return str(arg).replace("torch.", "")
    if isinstance(arg, float):
        return f"{arg:g}"
    return repr(arg) if isinstance(arg, str) else str(arg)


def _call(op: str, node: fx.Node) -> str:
    parts = [format_arg(a) for a in node.args]
    parts += [f"{k}={format_arg(v)}" for k, v in node.kwargs.items()]
    return f"{op}({', '.join(parts)})"


def _function_name(target) -> str:
    """``aten.view`` for ``torch.ops.aten.view.default``, the qualified name for a Python callable."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        return f"{packet._qualified_op_name.replace('::', '.')}"
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__name__", str(target))
    return name if module in ("", "builtins", "_operator", "operator") else f"{module.rsplit('.', 1)[-1]}.{name}"


def _module_view(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str, str]:
    """(kind, op, comm) of a call_module node."""
    module = gm.get_submodule(node.target)
    name = type(module).__name__
    if isinstance(module, SendActivation):
        return "send", name, f"send to stage {module.dst_stage} (edge {module.edge})"
    if isinstance(module, RecvActivation):
        return "recv", name, f"receive from stage {module.src_stage} (edge {module.edge})"
    if isinstance(module, GraphCollective):
        return "collective", name, f"{module.kind} over {module.axis} ({module.size} ranks)"
    if isinstance(getattr(module, "body", None), fx.GraphModule):
        return "region", name, f"recompute region ({getattr(module, 'mode', '?')})"
    return "compute", name, ""


def describe_node(gm: fx.GraphModule, node: fx.Node) -> NodeView:
    """The :class:`NodeView` of ``node`` (a node of ``gm``)."""
    info = get_meta(node, TENSOR)
    placement = get_meta(node, TP_PLACEMENT)
    stage = get_meta(node, STAGE)
    module = get_meta(node, MODULE)
    comm = ""
    if node.op == "placeholder":
        kind, op, line = "input", "input", f"{node.name} = input"
    elif node.op == "get_attr":
        param = get_meta(node, PARAM)
        kind, op = "param", (param.name if param else str(node.target))
        line = f"{node.name} = {'param' if param is None or param.is_parameter else 'buffer'} {op}"
    elif node.op == "output":
        kind, op, line = "output", "output", _call("output", node)
    elif node.op == "call_module":
        kind, op, comm = _module_view(gm, node)
        line = f"{node.name} = {_call(op, node)}"
    else:
        kind, op = "compute", _function_name(node.target)
        line = f"{node.name} = {_call(op, node)}"
    return NodeView(
        name=node.name, kind=kind, op=op, line=line,
        shape=None if info is None or info.shape is None else tuple(info.shape),
        dtype="" if info is None or info.dtype is None else str(info.dtype).replace("torch.", ""),
        placement="" if placement is None else str(placement),
        stage=None if stage is None else stage.stage,
        module="" if module is None else module.path, comm=comm)


def walk(gm: fx.GraphModule, depth: int = 0):
    """Yield ``(node, graph_module, depth)`` in order, descending into recompute regions' bodies."""
    for node in gm.graph.nodes:
        yield node, gm, depth
        if node.op == "call_module":
            body = getattr(gm.get_submodule(node.target), "body", None)
            if isinstance(body, fx.GraphModule):
                yield from walk(body, depth + 1)
