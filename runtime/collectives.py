"""autopar's differentiable collectives, inserted into graphs as visible ``call_module`` nodes.

Each module names the mesh axis it communicates over; the runtime binds the axis to a process
group before the graph runs (:func:`bind_collectives`). Unbound (a plan read in a plain process),
calling one raises. ``meta_forward`` gives the output's shape for shape propagation.

Megatron's pair for tensor parallelism:
- :class:`TpCopy` ("f"): identity forward, all-reduce of the gradient backward.
- :class:`TpReduce` ("g"): all-reduce forward, identity backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import RuntimeCommError

__all__ = ["GraphCollective", "TpCopy", "TpReduce", "bind_collectives", "collective_nodes"]


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GraphCollective(nn.Module):
    """Base of every communication node: knows its mesh axis, runs once bound to a group."""

    kind = "collective"

    def __init__(self, *, axis: str, size: int):
        super().__init__()
        self.axis = axis
        self.size = size
        self.group = None

    def bind(self, group) -> None:
        self.group = group

    def _require_group(self):
        if self.group is None:
            raise RuntimeCommError(
                f"{type(self).__name__} over mesh axis {self.axis!r} is not bound to a process group",
                where="a graph produced by autopar.plan()",
                fix="run graphs through autopar.compile() inside torchrun; plan() graphs are for reading")
        return self.group

    def meta_forward(self, x):
        return torch.empty_like(x)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}"


class TpCopy(GraphCollective):
    """f: identity forward; backward all-reduces the input gradient over the tp axis."""

    kind = "all_reduce(backward)"

    def forward(self, x):
        return _CopyToRegion.apply(x, self._require_group())


class TpReduce(GraphCollective):
    """g: forward all-reduces partial sums over the tp axis; backward is the identity."""

    kind = "all_reduce(forward)"

    def forward(self, x):
        return _ReduceFromRegion.apply(x, self._require_group())


def collective_nodes(gm, kind: type | None = None):
    """The call_module nodes of ``gm`` that call an autopar collective (optionally of one type)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, GraphCollective) and (kind is None or isinstance(module, kind)):
            found.append(node)
    return found


def bind_collectives(gm: nn.Module, groups: dict) -> None:
    """Bind every collective in ``gm`` to the process group of its mesh axis."""
    for module in gm.modules():
        if isinstance(module, GraphCollective) and module.axis in groups:
            module.bind(groups[module.axis])
