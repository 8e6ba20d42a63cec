"""What one rank knows of its place in the job, handed to every part of its program as one value.

- :class:`MeshInfo`: this rank's mesh coordinates, the process group of each axis, the global
  ranks along it and the device it computes on (every buffer the runtime makes is put there) (:func:`autopar.mesh.mesh_info` reads it off a DeviceMesh; the runtime never reads
  the mesh itself, so a program can also be built over a hand-made ``MeshInfo``).
- :class:`AxisGroup`: one mesh axis from this rank: its group, the ranks along it, this rank's index.
- :class:`RankContext`: the mesh info, the deadline of every collective with the error naming a
  missed one (:class:`~autopar.ops.comm_guard.CommGuard`, which also writes each collective into
  the rank's flight record, :mod:`autopar.ops.flight_record`) and the log of the step's dp traffic
  (:class:`~autopar.ops.comm_audit.CommLog`). Gradient sync, ZeRO's optimizer and the DDP
  buckets take it (or one of its axes) instead of a group, ranks, an index, a guard and a log each.
- :class:`ProgramState`: what checkpoints, the non-finite check, clipping, ``rank_tensors``,
  ``rng_state`` and the memory probe read of a program, written down as a Protocol.

Example::

    >>> from autopar.plan_model import MeshShape
    >>> info = MeshInfo(MeshShape(dp=2, pp=2), rank=3, coords={"dp": 1, "pp": 1, "tp": 0},
    ...                 axis_ranks={"dp": [1, 3], "pp": [2, 3], "tp": [3]})
    >>> info.peer("pp", 0)
    2
    >>> ctx = RankContext.create(info, timeout_s=5.0)
    >>> ctx.axis("dp")
    AxisGroup(group=None, ranks=(1, 3), index=1)
    >>> ctx.axis("dp").size, ctx.guard.timeout_s, ctx.comm_log.guard is ctx.guard
    (2, 5.0, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from autopar.ir.stage_graph import StageGraph
from autopar.ops.comm_audit import CommLog
from autopar.ops.comm_guard import CommGuard
from autopar.parallel_dims import JOINS, ParallelDims
from autopar.plan_model import MeshShape, Plan
from autopar.runtime.schedules.action import Schedule

__all__ = ["MeshInfo", "AxisGroup", "RankContext", "ProgramState"]


@dataclass
class MeshInfo:
    """This rank's view of the mesh: its coordinates, and for each axis (mesh or derived: ``ep``, ``edp``)
    the process group and the global ranks along it. ``dims``: every degree (default: the mesh's, no ep)."""

    shape: MeshShape
    rank: int
    coords: dict[str, int]
    groups: dict[str, object] = field(default_factory=dict)
    axis_ranks: dict[str, list[int]] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this rank computes
    dims: ParallelDims | None = None

    def __post_init__(self):
        if self.dims is None:
            self.dims = self.shape.dims

    def _same(self, axis: str) -> str:
        """A joined axis with one part of several ranks is that part (``dcp`` is dp and ``edcp`` edp without cp),
        where no group of its own was made (a hand-made MeshInfo need not list it)."""
        if axis not in JOINS or axis in self.groups:
            return axis
        wide = [part for part in JOINS[axis] if self.dims.size(part) > 1]
        return axis if len(wide) > 1 else (wide or JOINS[axis])[0]

    def group(self, axis: str):
        """The process group along ``axis`` (None: a world of one)."""
        return self.groups.get(self._same(axis))

    def ranks(self, axis: str) -> list[int]:
        """The global ranks along ``axis``, in order of their position on it."""
        return self.axis_ranks.get(self._same(axis), [self.rank])

    def peer(self, axis: str, index: int) -> int:
        """Global rank of the rank at ``index`` along ``axis`` sharing my other coordinates."""
        return self.axis_ranks[axis][index]

    def index(self, axis: str) -> int:
        """This rank's position along ``axis``, a mesh axis or a derived one (:class:`ParallelDims`)."""
        return self.dims.index(axis, self.coords)


@dataclass(frozen=True)
class AxisGroup:
    """One mesh axis seen from this rank: its process group, the global ranks along it, this rank's index."""

    group: Any
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class RankContext:
    """What every part of this rank's program shares: where it is, its groups, its deadline, its log."""

    info: MeshInfo
    guard: CommGuard  # the deadline of every collective, and the error naming a missed one
    comm_log: CommLog  # this step's dp collectives (ops/comm_audit.py)

    @classmethod
    def create(cls, info: MeshInfo, *, timeout_s: float, place: Callable[[], str] = lambda: "",
               flight=None) -> RankContext:
        """The context of rank ``info.rank``; ``place`` says what the rank is doing, for a collective's error;
        ``flight``: the rank's FlightRecord, which its collectives are written into (None: no record)."""
        guard = CommGuard(rank=info.rank, timeout_s=timeout_s, place=place, flight=flight)
        return cls(info=info, guard=guard, comm_log=CommLog(guard=guard))

    @property
    def rank(self) -> int:
        return self.info.rank

    def axis(self, name: str) -> AxisGroup:
        """Axis ``name`` (``dp``, ``cp``, ``pp``, ``tp``; ``ep`` / ``edp`` carved out of dp; ``dcp`` = dp x cp)
        from this rank."""
        return AxisGroup(group=self.info.group(name), ranks=tuple(self.info.ranks(name)), index=self.info.index(name))


class ProgramState(Protocol):
    """What the runtime's readers of a program use (checkpoint, numerics, clip, rank_tensors, rng_state,
    memory_probe); every program kind has it (:class:`autopar.runtime.execution.program.RankProgram` and the others)."""

    plan: Plan
    info: MeshInfo
    schedule: Schedule
    stages: dict[int, StageGraph]  # this rank's stages by index
    named_params: list[tuple[str, torch.nn.Parameter]]
    optimizer: Any  # runtime/state/zero.py's ShardedOptimizer
    comm_guard: CommGuard
    state_keys: tuple[str, ...]
    aliases: dict[str, tuple[str, ...]]
    unused: tuple  # the model's tensors no stage graph reads (runtime/state/unused_state.py)
    step_count: int

    @property
    def graphs(self) -> dict[int, torch.fx.GraphModule]: ...

    def parameter_values(self) -> list[tuple[str, torch.Tensor]]: ...
