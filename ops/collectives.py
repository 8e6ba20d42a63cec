"""autopar's differentiable collectives, inserted into graphs as visible ``call_module`` nodes.

Each module names the mesh axis it communicates over; the runtime binds the axis to a process
group, and the rank's :class:`~autopar.ops.comm_guard.CommGuard`, before the graph runs
(:func:`bind_collectives`): every collective then waits at most ``p2p_timeout_s`` and a missed
one is a RuntimeCommError naming the node. Unbound (a plan read in a plain process), calling
one raises. ``meta_forward`` gives the output's shape for shape propagation, and
``comm(in_bytes, out_bytes)`` says what the node sends (for the collective audit).

Megatron's pair for tensor parallelism:
- :class:`TpCopy` ("f"): identity forward, all-reduce of the gradient backward.
- :class:`TpReduce` ("g"): all-reduce forward, identity backward.

Their sequence-parallel forms, and the two conversions between a replicated and a dim-sharded
value outside the tensor-parallel regions:
- :class:`SpAllGather` (f with sequence parallelism): all-gather on ``dim`` forward,
  reduce-scatter of the gradient backward.
- :class:`SpReduceScatter` (g with sequence parallelism): reduce-scatter on ``dim`` forward,
  all-gather of the gradient backward.
- :class:`TpGather`: all-gather on ``dim`` forward, keep this rank's slice of the gradient backward.
- :class:`TpScatter`: keep this rank's slice forward, all-gather the gradient backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import RuntimeCommError
from autopar.ir.shard_layout import ShardLayout
from autopar.ops.comm_guard import CommGuard

__all__ = ["GraphCollective", "TpCopy", "TpReduce", "SpAllGather", "SpReduceScatter", "TpGather",
           "TpScatter", "Comm", "bind_collectives", "collective_nodes", "all_gather_dim",
           "reduce_scatter_dim", "split_dim", "issue"]


@dataclass(frozen=True)
class Comm:
    """One collective a node runs: direction ('forward'/'backward'), op, bytes of the full tensor."""

    direction: str
    op: str
    nbytes: int
    recompute: bool = False


# -- tensor-dim collectives over one process group -----------------------------------------------
def issue(collective: str, fn, /, *args, group, guard: CommGuard | None, purpose: str, **kwargs) -> None:
    """Run collective ``fn`` (named ``collective``) over ``group``: under ``guard``'s deadline when there is one."""
    if guard is None:
        fn(*args, group=group, **kwargs)
    else:
        guard.run(collective, fn, *args, group=group, purpose=purpose, **kwargs)


def all_gather_dim(x: torch.Tensor, dim: int, group, guard: CommGuard | None = None,
                   purpose: str = "a tensor-parallel all-gather") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    flat = x.reshape(-1)
    buf = torch.empty(size * flat.numel(), dtype=x.dtype, device=x.device)
    issue("all_gather", dist.all_gather_single, buf, flat, group=group, guard=guard, purpose=purpose)
    return ShardLayout(dim).join(list(buf.view((size,) + tuple(x.shape)).unbind(0)), size=size)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group, guard: CommGuard | None = None,
                       purpose: str = "a tensor-parallel reduce-scatter") -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``dim``."""
    size = dist.get_world_size(group)
    stacked = torch.stack(ShardLayout(dim).pieces(x, size=size), dim=0).contiguous()
    out = torch.empty(stacked[0].numel(), dtype=x.dtype, device=x.device)
    issue("reduce_scatter", dist.reduce_scatter_single, out, stacked.reshape(-1), group=group, guard=guard,
          purpose=purpose)
    return out.view(stacked.shape[1:])


def split_dim(x: torch.Tensor, dim: int, group, guard=None, purpose: str = "") -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    return ShardLayout(dim).cut(x, rank=dist.get_rank(group), size=dist.get_world_size(group))


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, guard, purpose):
        ctx.group, ctx.guard, ctx.purpose = group, guard, purpose
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand one gradient tensor to several backward functions (both operands of an add
        # get the add's), so an all-reduce in place would sum the other reader's gradient too (Mixtral's router
        # loss accumulates each layer's statistic, all-reduced over cp, into one sum: layer 0's came out doubled)
        grad = grad.clone(memory_format=torch.contiguous_format)
        issue("all_reduce", dist.all_reduce, grad, group=ctx.group, guard=ctx.guard, purpose=ctx.purpose)
        return grad, None, None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, guard, purpose):
        out = x.contiguous().clone()
        issue("all_reduce", dist.all_reduce, out, group=group, guard=guard, purpose=purpose)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _DimCollective(torch.autograd.Function):
    """Forward op / backward op pair on one tensor dim, chosen by name."""

    _OPS = {"all_gather": all_gather_dim, "reduce_scatter": reduce_scatter_dim, "split": split_dim}

    @staticmethod
    def forward(ctx, x, dim, group, fwd, bwd, guard, purpose):
        ctx.dim, ctx.group, ctx.bwd, ctx.guard, ctx.purpose = dim, group, bwd, guard, purpose
        return _DimCollective._OPS[fwd](x, dim, group, guard, purpose)

    @staticmethod
    def backward(ctx, grad):
        out = _DimCollective._OPS[ctx.bwd](grad, ctx.dim, ctx.group, ctx.guard, ctx.purpose)
        return out, None, None, None, None, None, None


class GraphCollective(nn.Module):
    """Base of every communication node: knows its mesh axis, runs once bound to a group."""

    kind = "collective"

    def __init__(self, *, axis: str, size: int):
        super().__init__()
        self.axis = axis
        self.size = size
        self.group = None
        self.guard: CommGuard | None = None
        self.node_name = type(self).__name__

    def bind(self, group, guard: CommGuard | None = None, name: str | None = None) -> None:
        self.group, self.guard = group, guard
        self.node_name = name or self.node_name

    @property
    def purpose(self) -> str:
        """How a timeout names this node: its class, graph node and mesh axis."""
        return f"{type(self).__name__} node {self.node_name} (mesh axis {self.axis})"

    def _require_group(self):
        if self.group is None:
            raise RuntimeCommError(
                f"{type(self).__name__} over mesh axis {self.axis!r} is not bound to a process group",
                where="a graph produced by autopar.plan()",
                fix="run graphs through autopar.compile() inside torchrun; plan() graphs are for reading")
        return self.group

    def meta_forward(self, x):
        return torch.empty_like(x)

    def comm(self, in_bytes: int, out_bytes: int) -> list[Comm]:
        """The collectives this node runs for one call, with the bytes of the full tensor."""
        return []

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}"


class TpCopy(GraphCollective):
    """f: identity forward; backward all-reduces the input gradient over the tp axis."""

    kind = "all_reduce(backward)"

    def forward(self, x):
        return _CopyToRegion.apply(x, self._require_group(), self.guard, f"the backward of {self.purpose}")

    def comm(self, in_bytes, out_bytes):
        return [Comm("backward", "all_reduce", in_bytes)]


class TpReduce(GraphCollective):
    """g: forward all-reduces partial sums over the tp axis; backward is the identity."""

    kind = "all_reduce(forward)"

    def forward(self, x):
        return _ReduceFromRegion.apply(x, self._require_group(), self.guard, self.purpose)

    def comm(self, in_bytes, out_bytes):
        return [Comm("forward", "all_reduce", out_bytes)]


class _DimModule(GraphCollective):
    """A collective on tensor dim ``dim``: forward op ``fwd``, backward op ``bwd``."""

    fwd = bwd = ""

    def __init__(self, *, axis: str, size: int, dim: int):
        super().__init__(axis=axis, size=size)
        self.dim = dim

    def forward(self, x):
        return _DimCollective.apply(x, self.dim, self._require_group(), self.fwd, self.bwd, self.guard, self.purpose)

    def meta_forward(self, x):
        shape = list(x.shape)
        if self.fwd == "all_gather":
            shape[self.dim] *= self.size
        else:
            shape[self.dim] //= self.size
        return x.new_empty(shape)

    def comm(self, in_bytes, out_bytes):
        full = max(in_bytes, out_bytes)
        return [Comm(d, op, full) for d, op in (("forward", self.fwd), ("backward", self.bwd))
                if op != "split"]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, dim={self.dim}"


class SpAllGather(_DimModule):
    """f under sequence parallelism: all-gather on ``dim``; backward reduce-scatters the gradient."""

    kind = "all_gather(forward)+reduce_scatter(backward)"
    fwd, bwd = "all_gather", "reduce_scatter"


class SpReduceScatter(_DimModule):
    """g under sequence parallelism: reduce-scatter on ``dim``; backward all-gathers the gradient."""

    kind = "reduce_scatter(forward)+all_gather(backward)"
    fwd, bwd = "reduce_scatter", "all_gather"


class TpGather(_DimModule):
    """All-gather on ``dim`` for replicated consumers; backward keeps this rank's gradient slice."""

    kind = "all_gather(forward)"
    fwd, bwd = "all_gather", "split"


class TpScatter(_DimModule):
    """Keep this rank's slice on ``dim``; backward all-gathers the gradient."""

    kind = "all_gather(backward)"
    fwd, bwd = "split", "all_gather"


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


def bind_collectives(gm: nn.Module, groups: dict, guard: CommGuard | None = None) -> None:
    """Bind every collective in ``gm`` to the process group of its mesh axis (and the rank's guard)."""
    for name, module in gm.named_modules():
        if isinstance(module, GraphCollective) and module.axis in groups:
            module.bind(groups[module.axis], guard, name)
