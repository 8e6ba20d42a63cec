"""ZeRO-3's graph collectives: gather a group of sharded parameters before use, free them after.

:mod:`autopar.passes.data_parallel.zero3` puts these ``call_module`` nodes into a stage graph:

- :class:`ZeroGather` (``zero3_gather_k``): forward all-gathers the flat 1/N shards of a group
  of parameters (a pipeline unit's) over dp and returns the full parameters; it starts the next
  group's all-gather before waiting for its own (prefetch). Backward reduce-scatters the full
  gradients into the shards' gradients, divided by N (the dp mean), then frees the full storage.
- :class:`ZeroFree` (``zero3_free_k``): placed after the group's last use. Forward returns its
  first input unchanged and frees the full parameters' storage (autograd keeps only the empty
  tensor objects). Backward, which autograd runs before the backward of any use (every use's
  gradient flows through it), all-gathers the parameters again into that storage, and starts
  the all-gather of the group whose free precedes it in the graph (backward's next: prefetch).

Layout: each parameter is flattened and zero-padded to a multiple of N; rank r holds block r.
A group's shards are concatenated, so one collective serves the whole group.
:func:`shard_zero3_parameters` replaces a stage graph's full parameters with this rank's shards.

Axes: a group is sharded over ``dp`` (N = dp, rank r = the dp index), or, for mixture-of-experts
expert tensors split over ep, over ``edp``, the dp / ep ranks holding the same experts (N = edp, rank r =
the edp index: :class:`autopar.parallel_dims.ParallelDims`). Either way the reduce-scattered
gradient is divided by dp (``divide_by``): an expert's gradient already sums every token of its ep
group, so its sum over edp divided by dp is the dp mean every other parameter gets.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from autopar.ir.shard_layout import ZERO3
from autopar.ops import comm_audit as comm
from autopar.ops.collectives import GraphCollective
from autopar.parallel_dims import ParallelDims

__all__ = ["ZeroGather", "ZeroFree", "Zero3Runtime", "Zero3Shard", "shard_zero3_parameters", "full_parameters",
           "bind_zero3", "padded_numel", "zero3_targets", "zero3_shards"]


def padded_numel(numel: int, size: int) -> int:
    """``numel`` rounded up to a multiple of ``size``: the flat blocks of :data:`ZERO3` over ``size`` ranks."""
    return ZERO3.local_size(numel, size) * size


@dataclass(frozen=True)
class Zero3Shard:
    """How a graph holds one ZeRO-3 parameter: its (tp-local) shape, the mesh axis and size it is sharded over."""

    shape: tuple[int, ...]
    axis: str
    size: int

    def index(self, dims: ParallelDims, coords: dict[str, int]) -> int:
        """The block the rank at mesh coordinates ``coords`` holds: its position along :attr:`axis`."""
        return dims.index(self.axis, coords)


class Zero3Runtime:
    """One stage graph's ZeRO-3 state at run time: the comm log and prefetched gathers (each gather
    communicates over the group its axis is bound to: :func:`autopar.ops.collectives.bind_collectives`)."""

    def __init__(self, gm, *, comm_log=None):
        self.gm, self.comm_log = gm, comm_log
        self.pending: dict[tuple[str, int], tuple] = {}

    def start(self, gather: "ZeroGather", purpose: str):
        """Start an async all-gather of ``gather``'s group; returns (work, [N, S] buffer)."""
        shards = [self.gm.get_parameter(t).detach() for t in gather.targets]
        flat = torch.cat([s.reshape(-1) for s in shards])
        out = torch.empty(gather.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        work = comm.all_gather_into(out, flat, group=gather.group, size=gather.size, log=self.comm_log,
                                    purpose=purpose, async_op=True)
        return work, out.view(gather.size, -1)

    def take(self, gather: "ZeroGather", phase: str):
        """The group's gathered [N, S] buffer: the prefetched one, or gathered now."""
        handle = self.pending.pop((phase, gather.index), None)
        if handle is None:
            handle = self.start(gather, f"zero3_gather_{phase}")
        handle[0].wait()
        return handle[1]

    def prefetch(self, target: str | None, phase: str) -> None:
        if target is None:
            return
        gather = self.gm.get_submodule(target)
        if (phase, gather.index) not in self.pending:
            self.pending[(phase, gather.index)] = self.start(gather, f"zero3_gather_{phase}")

    def drain(self) -> None:
        """Wait for prefetches nobody consumed (all ranks issued the same ones)."""
        for work, _ in self.pending.values():
            work.wait()
        self.pending.clear()


def _copy_out(gather: "ZeroGather", buffer: torch.Tensor, into: list | None = None) -> list[torch.Tensor]:
    """Full parameters from a gathered [N, S] buffer (into fresh tensors, or into ``into``'s storage)."""
    fulls, offset = [], 0
    for i, (shape, numel) in enumerate(zip(gather.shapes, gather.numels)):
        block = ZERO3.local_size(numel, gather.size)
        data = buffer[:, offset: offset + block].reshape(-1)
        offset += block
        if into is None:
            fulls.append(data[:numel].view(shape).clone())
            continue
        full = into[i]
        storage = full.untyped_storage()
        storage.resize_(numel * full.element_size())
        alias = torch.empty(0, dtype=full.dtype, device=full.device).set_(storage, 0, (numel,), (1,))
        alias.copy_(data[:numel])  # writes through another tensor: autograd's saved copy keeps its version
        fulls.append(full)
    return fulls


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, *shards):
        ctx.module = module
        runtime = module.runtime
        buffer = runtime.take(module, "forward")
        runtime.prefetch(module.next_gather, "forward")
        fulls = _copy_out(module, buffer)
        ctx.fulls = [weakref.ref(f) for f in fulls]
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        module = ctx.module
        n = module.size
        blocks = [ZERO3.local_size(k, n) for k in module.numels]
        device = module.runtime.gm.get_parameter(module.targets[0]).device
        inp = torch.zeros(n, sum(blocks), dtype=module.dtype, device=device)
        offset = 0
        for g, numel, block in zip(grads, module.numels, blocks):
            if g is not None:  # rank r's row: block r of the flat gradient (reduce-scattered to rank r)
                inp[:, offset: offset + block] = torch.stack(ZERO3.pieces(g.reshape(-1), size=n))
            offset += block
        out = torch.empty(sum(blocks), dtype=module.dtype, device=device)
        comm.reduce_scatter_into(out, inp.view(-1), group=module.group, size=n,
                                 log=module.runtime.comm_log, purpose="zero3_reduce_scatter")
        out.div_(module.divide_by)
        for ref in ctx.fulls:
            full = ref()
            if full is not None:
                full.untyped_storage().resize_(0)
        pieces = list(out.split(blocks))
        return (None, *pieces)


class _Free(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, token, *fulls):
        ctx.module, ctx.fulls = module, fulls
        for f in fulls:
            f.untyped_storage().resize_(0)
        return token.view_as(token)

    @staticmethod
    def backward(ctx, grad):
        module = ctx.module
        gather = module.gm_gather()
        runtime = gather.runtime
        buffer = runtime.take(gather, "backward")
        runtime.prefetch(module.prev_gather, "backward")
        _copy_out(gather, buffer, into=list(ctx.fulls))
        return (None, grad, *([None] * len(ctx.fulls)))


class ZeroGather(GraphCollective):
    """All-gather a group of sharded parameters (forward); reduce-scatter their gradients (backward).

    ``axis``: ``dp``, or ``edp`` for expert tensors split over ep; ``divide_by``: the mean's divisor of the
    reduce-scattered gradients (dp for both axes; default ``size``)."""

    kind = "all_gather(forward), reduce_scatter(backward)"

    def __init__(self, *, size: int, index: int, targets: tuple[str, ...], shapes: tuple, dtype: torch.dtype,
                 next_gather: str | None = None, axis: str = "dp", divide_by: int | None = None):
        super().__init__(axis=axis, size=size)
        self.index, self.targets, self.dtype, self.next_gather = index, tuple(targets), dtype, next_gather
        self.divide_by = size if divide_by is None else divide_by
        self.shapes = tuple(tuple(s) for s in shapes)
        self.numels = tuple(math.prod(s) for s in self.shapes)
        self.runtime = None

    def forward(self, *shards):
        self._require_group()
        return _Gather.apply(self, *shards)

    def meta_forward(self, *shards):
        return tuple(torch.empty(s, dtype=self.dtype, device=shards[0].device if shards else "cpu") for s in self.shapes)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, params={len(self.targets)}"


class ZeroFree(GraphCollective):
    """After a group's last use: free the full parameters (forward); gather them again (backward)."""

    kind = "free(forward), all_gather(backward)"

    def __init__(self, *, size: int, gather: str, prev_gather: str | None = None, axis: str = "dp"):
        super().__init__(axis=axis, size=size)
        self.gather, self.prev_gather = gather, prev_gather
        self._gather_ref = None

    def gm_gather(self) -> ZeroGather:
        return self._gather_ref()

    def forward(self, token, *fulls):
        self._require_group()
        return _Free.apply(self, token, *fulls)

    def meta_forward(self, token, *fulls):
        return torch.empty_like(token)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, gather={self.gather!r}"


def _gathers(gm) -> list[ZeroGather]:
    return [m for m in gm.modules() if isinstance(m, ZeroGather)]


def zero3_targets(gm) -> list[str]:
    """Targets of ``gm``'s parameters that ZeRO-3 gathers (and therefore holds as flat 1/N shards)."""
    return [t for gather in _gathers(gm) for t in gather.targets]


def zero3_shards(gms: list) -> dict[str, Zero3Shard]:
    """{graph target: its :class:`Zero3Shard`} of every parameter the graphs hold as flat ZeRO-3 blocks."""
    return {t: Zero3Shard(tuple(shape), gather.axis, gather.size) for gm in gms for gather in _gathers(gm)
            for t, shape in zip(gather.targets, gather.shapes)}


def shard_zero3_parameters(gms: list, *, dims: ParallelDims, coords: dict[str, int]) -> None:
    """Replace each gathered parameter of ``gms`` by the flat 1/N shard of the rank at ``coords`` (ties kept):
    N and the block are the size of the gather's axis and the rank's position on it (dp; edp for expert
    tensors split over ep)."""
    shards: dict[int, torch.nn.Parameter] = {}
    for gm in gms:
        for gather in _gathers(gm):
            size, rank = dims.size(gather.axis), dims.index(gather.axis, coords)
            assert gather.size == size, (gather.axis, gather.size, size)
            for target in gather.targets:
                full = gm.get_parameter(target)
                if id(full) not in shards:
                    shards[id(full)] = torch.nn.Parameter(ZERO3.cut(full.detach().reshape(-1), rank=rank, size=size),
                                                          requires_grad=full.requires_grad)
                owner, _, leaf = target.rpartition(".")
                setattr(gm.get_submodule(owner) if owner else gm, leaf, shards[id(full)])


def bind_zero3(gm, *, comm_log=None) -> Zero3Runtime | None:
    """Give ``gm``'s ZeRO-3 nodes their run-time state (after ``bind_collectives``); None if it has none."""
    gathers = _gathers(gm)
    if not gathers:
        return None
    runtime = Zero3Runtime(gm, comm_log=comm_log)
    for gather in gathers:
        gather.runtime = runtime
    for module in gm.modules():
        if isinstance(module, ZeroFree):
            module._gather_ref = weakref.ref(gm.get_submodule(module.gather))
    return runtime


def full_parameters(named: list[tuple[str, torch.nn.Parameter]], gms: list):
    """(name, full tensor) for every parameter: ZeRO-3 shards all-gathered over their gather's bound group
    (dp, or edp for expert tensors: still this ep rank's experts), others as they are."""
    layout, by_name = {}, {}
    for gm in gms:
        for gather in _gathers(gm):
            for target, shape in zip(gather.targets, gather.shapes):
                layout[id(gm.get_parameter(target))] = (shape, gather)
                by_name[target.partition(".")[2]] = (shape, gather)  # user name: bf16 runs gather their fp32 masters
    out = []
    for name, p in named:
        found = layout.get(id(p), by_name.get(name))
        if found is None:
            out.append((name, p))
            continue
        shape, gather = found
        buffer = torch.empty(gather.size * p.numel(), dtype=p.dtype, device=p.device)
        comm.all_gather_into(buffer, p.detach().contiguous(), group=gather.group, size=gather.size, log=None,
                             purpose="state_dict")
        out.append((name, buffer[:math.prod(shape)].view(shape)))
    return out
