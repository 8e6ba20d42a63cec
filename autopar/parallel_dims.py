"""Every degree of a job's parallelism in one frozen object: sizes, validation, coordinates and groups.

The shared vocabulary of the planner, the passes and the runtime (``../shared/design.md`` section 6):
what an axis is, how big, where a rank sits on it and which ranks share a group are written here once
and read everywhere else.

- **Mesh axes** (:data:`MESH_AXES`): the dims of the job's ``DeviceMesh``, outermost first. A global
  rank's coordinates are row-major over them, as :func:`autopar.init_mesh` lays the ranks out.
- **Derived axes** carve a mesh axis into sub-axes (:data:`SPLITS`): mixture-of-experts expert
  parallelism splits dp into ``edp`` (outer) x ``ep`` (inner), so dp index ``d`` is ep rank
  ``d % ep`` of the ep group ``d // ep`` (contiguous dp indices, as torchtitan carves its data shards)
  and the ``edp = dp / ep`` ranks holding the same experts share ``d % ep``. On a live job both are
  dims of the one DeviceMesh, its dp dim unflattened (:func:`mesh_groups`), never side groups.

- **Joined axes** (:data:`JOINS`) are groups over several axes (mesh or derived): ``dcp = dp x cp``, the ranks
  whose gradients of one weight sum to the step's (each holds other rows or other positions of the batch),
  over which DDP buckets and ZeRO shard. Its index is row-major (``dp * cp_size + cp``); with ``cp = 1`` it is
  dp itself. ``edcp = edp x cp`` is the same for an expert tensor split over ep: the ranks holding the same
  experts (same ep index, pp and tp) and other tokens (other dp rows, or other positions of them), over which
  the experts' gradients are summed and ZeRO partitions them; with ``cp = 1`` it is edp itself.

  Why the ep group stays at one cp coordinate: ep is carved out of dp, so a rank's ep peers are the ranks of
  its block of dp indices with its own cp (and pp, tp) coordinate. Routing is per token, so any group that
  holds every expert once could serve a rank's tokens; this one exchanges rows of one cp shard, and each
  expert then sees, on its ``edp x cp`` holders, every token of the step exactly once (each holder's ep
  group brings it the tokens of one (dp block, cp shard)), which is why its gradient is summed over
  ``edcp`` and nothing wider or narrower: edp alone would miss the other cp shards' tokens.

Context parallelism (``cp``) is a mesh axis right inside dp (a rank's cp peers are adjacent ranks, and
dp x cp is one contiguous block of the mesh). Adding an axis is a field here, its rule in
:meth:`ParallelDims.problem`, its place in :data:`MESH_AXES` (a mesh dim), :data:`SPLITS` (carved out of one)
or :data:`JOINS`, and nothing else in this module: coordinates, group layouts and the DeviceMesh's groups
follow from those tables.

    >>> dims = ParallelDims(dp=4, pp=2, tp=1, ep=2)
    >>> dims.edp, dims.world_size
    (2, 8)
    >>> dims.coords(5), dims.rank(dp=2, pp=1, tp=0)
    ({'dp': 2, 'pp': 1, 'tp': 0}, 5)
    >>> dims.index("ep", dims.coords(5)), dims.index("edp", dims.coords(5))
    (0, 1)
    >>> dims.axis_ranks("ep", 5), dims.axis_ranks("edp", 5)
    ([5, 7], [1, 5])
    >>> ParallelDims(dp=4, ep=2).groups("ep"), ParallelDims(dp=4, ep=2).groups("edp")
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    >>> cp = ParallelDims(dp=2, cp=2, tp=2)
    >>> cp.coords(3), cp.groups("cp")[:2], cp.axis_ranks("dcp", 3), cp.index("dcp", cp.coords(6))
    ({'dp': 0, 'cp': 1, 'pp': 0, 'tp': 1}, [[0, 2], [1, 3]], [1, 3, 5, 7], 3)
    >>> cpep = ParallelDims(dp=4, cp=2, ep=2)   # ranks 2 * dp + cp
    >>> cpep.groups("ep")[:2], cpep.groups("edp")[:2], cpep.groups("edcp")
    ([[0, 2], [1, 3]], [[0, 4], [1, 5]], [[0, 1, 4, 5], [2, 3, 6, 7]])
    >>> cpep.edcp, cpep.index("edcp", cpep.coords(5))
    (4, 3)
    >>> ParallelDims(dp=4, ep=3)
    Traceback (most recent call last):
    ...
    autopar.errors.PlanError: expert_parallel=3 does not divide dp=4. Where: the mesh dp=4 x pp=1 x tp=1, expert_parallel=3. Fix: use an expert_parallel that divides 4.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from autopar.errors import PlanError

__all__ = ["ParallelDims", "MESH_AXES", "SPLITS", "JOINS", "AXES", "mesh_groups"]

#: the dims of the job's DeviceMesh, outermost first: a rank's coordinates are row-major over them
MESH_AXES = ("dp", "cp", "pp", "tp")
#: a mesh axis -> the sub-axes it is carved into (outermost first); their sizes multiply to the axis's
SPLITS = {"dp": ("edp", "ep")}
#: a joined axis -> the adjacent mesh axes it spans (outermost first): one group over all of them
JOINS = {"dcp": ("dp", "cp"), "edcp": ("edp", "cp")}
#: every axis a rank has a coordinate on and a group along
AXES = MESH_AXES + tuple(sub for parts in SPLITS.values() for sub in parts) + tuple(JOINS)
#: how each degree is called where a user sets it (an error names the option to change)
_OPTION = {"dp": "dp", "cp": "cp", "pp": "pp", "tp": "tp", "ep": "expert_parallel"}


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every axis (``dp``, ``cp``, ``pp``, ``tp``, ``ep``; ``edp = dp / ep``, ``dcp = dp x cp`` and
    ``edcp = edp x cp`` derived), validated."""

    dp: int = 1
    cp: int = 1  # context parallelism: the sequence cut over cp ranks (ops/context_parallel)
    pp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: carved out of dp (SPLITS)

    def __post_init__(self):
        problem = self.problem(**{f.name: getattr(self, f.name) for f in fields(self)})
        if problem:
            raise PlanError(problem[0], where=f"the mesh {self.mesh_text()}, expert_parallel={self.ep}",
                            fix=problem[1])

    @classmethod
    def problem(cls, **degrees) -> tuple[str, str] | None:
        """(what is wrong, the fix) when ``degrees`` (the fields' names; the rest 1) cannot form a job, else None.
        The planner asks it before building candidates; construction raises it as a PlanError."""
        d = {f.name: 1 for f in fields(cls)} | degrees
        for axis, value in d.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return (f"{_OPTION[axis]}={value!r} is not a positive int",
                        f"set {_OPTION[axis]} to a whole number of ranks, at least 1")
        if d["dp"] % d["ep"]:
            return f"expert_parallel={d['ep']} does not divide dp={d['dp']}", f"use an expert_parallel that divides {d['dp']}"
        return None

    @classmethod
    def of(cls, mesh, *, ep: int = 1) -> ParallelDims:
        """The dims of a mesh shape (anything with ``dp``, ``pp``, ``tp`` and maybe ``cp``: a MeshShape) and ``ep``."""
        return cls(**{axis: getattr(mesh, axis, 1) for axis in MESH_AXES}, ep=ep)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def edp(self) -> int:
        """The ranks holding the same experts: dp / ep."""
        return self.dp // self.ep

    @property
    def dcp(self) -> int:
        """The ranks one weight's gradient is summed over: dp x cp."""
        return self.dp * self.cp

    @property
    def edcp(self) -> int:
        """The ranks one expert tensor's gradient is summed over: edp x cp (the same experts, other tokens)."""
        return self.edp * self.cp

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in MESH_AXES)

    def size(self, axis: str) -> int:
        """The degree of ``axis`` (a mesh axis or a derived one)."""
        if axis not in AXES:
            raise KeyError(f"unknown axis {axis!r}; axes are {AXES}")
        return getattr(self, axis)

    def mesh_text(self) -> str:
        return " x ".join(f"{axis}={self.size(axis)}" for axis in MESH_AXES if axis != "cp" or self.cp > 1)

    # -- coordinates ------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of global ``rank`` (row-major over :data:`MESH_AXES`; ``cp`` only when cp > 1,
        as a mesh without context parallelism has no cp dim)."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the mesh {self.mesh_text()}", where="the rank asked for",
                            fix=f"pick a rank in 0..{self.world_size - 1}")
        out = {}
        for axis in reversed(MESH_AXES):
            rank, out[axis] = divmod(rank, self.size(axis))
        return {axis: out[axis] for axis in MESH_AXES if axis != "cp" or self.cp > 1}

    def rank(self, **coords: int) -> int:
        """The global rank at mesh coordinates ``coords`` (an axis left out is 0)."""
        rank = 0
        for axis in MESH_AXES:
            rank = rank * self.size(axis) + coords.get(axis, 0)
        return rank

    def index(self, axis: str, coords: dict[str, int]) -> int:
        """The position along ``axis`` (mesh or derived) of the rank at mesh coordinates ``coords``."""
        if axis in coords:
            return coords[axis]
        if axis in JOINS:
            position = 0
            for part in JOINS[axis]:
                position = position * self.size(part) + self.index(part, coords)
            return position
        if axis in MESH_AXES:  # (coordinates written before the axis existed: 0 on it)
            return 0
        parent, parts = self._split_of(axis)
        return self._unravel(parent, coords[parent])[parts.index(axis)]

    def _split_of(self, axis: str) -> tuple[str, tuple[str, ...]]:
        for parent, parts in SPLITS.items():
            if axis in parts:
                return parent, parts
        raise KeyError(f"unknown axis {axis!r}; axes are {AXES}")

    def _unravel(self, parent: str, position: int) -> tuple[int, ...]:
        """A position along mesh axis ``parent`` as positions along its sub-axes (row-major)."""
        out = []
        for sub in reversed(SPLITS[parent]):
            position, here = divmod(position, self.size(sub))
            out.append(here)
        return tuple(reversed(out))

    def _ravel(self, parent: str, positions: dict[str, int]) -> int:
        position = 0
        for sub in SPLITS[parent]:
            position = position * self.size(sub) + positions[sub]
        return position

    def _moved(self, coords: dict[str, int], axis: str, position: int) -> dict[str, int]:
        """Mesh coordinates ``coords`` with the position along ``axis`` (a mesh or split axis) set to ``position``."""
        if axis in MESH_AXES:
            return {**coords, axis: position}
        parent, parts = self._split_of(axis)
        here = dict(zip(parts, self._unravel(parent, coords[parent])))
        return {**coords, parent: self._ravel(parent, {**here, axis: position})}

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis``, in order of their position on it."""
        out = [self.coords(rank)]
        for part in JOINS.get(axis, (axis,)):  # a joined axis: row-major over its parts
            out = [self._moved(c, part, i) for c in out for i in range(self.size(part))]
        return [self.rank(**c) for c in out]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, as lists of global ranks, ordered by their first rank."""
        seen, out = set(), []
        for rank in range(self.world_size):
            if rank not in seen:
                ranks = self.axis_ranks(axis, rank)
                seen.update(ranks)
                out.append(ranks)
        return out


def mesh_groups(dims: ParallelDims, mesh) -> dict[str, tuple[object, list[int], int]]:
    """{axis: (process group, its global ranks, this rank's position)} of every split and joined axis, built from
    ``mesh``.

    Collective: every rank calls it. The mesh axis a split carves (dp) is unflattened into its sub-axes
    (``DeviceMesh._unflatten``), so ep and edp are dims of the same mesh, made once per program. A split
    whose inner parts are all of size 1 needs no groups of its own (ep=1: edp is dp itself). A joined axis is
    its parts flattened, on the mesh (or the unflattened one) that has them as dims; one with a single part
    present, or every part after the first of size 1, is that part itself (cp=1: dcp is dp, edcp is edp)."""
    names = tuple(mesh.mesh_dim_names or ())
    coords = dict(zip(names, mesh.get_coordinate()))
    out, meshes = {}, [mesh]
    for parent, parts in SPLITS.items():
        sizes = tuple(dims.size(p) for p in parts)
        if parent not in names or all(s == 1 for s in sizes[1:]):  # the outer part is the whole axis
            continue
        sub = mesh._unflatten(parent, sizes, parts)
        meshes.append(sub)
        coordinate = sub.get_coordinate()
        for axis in parts:
            group_mesh = sub[axis]
            out[axis] = (sub.get_group(axis), [int(r) for r in group_mesh.mesh.tolist()],
                         coordinate[sub.mesh_dim_names.index(axis)])
    for joined, parts in JOINS.items():  # dcp: dp x cp; edcp: edp x cp (the mesh's dims, flattened)
        on = max(meshes, key=lambda m: sum(p in m.mesh_dim_names for p in parts))
        present = [p for p in parts if p in on.mesh_dim_names]
        if len(present) < 2 or all(dims.size(p) == 1 for p in present[1:]):
            continue
        flat = on[tuple(present)]._flatten(joined)
        out[joined] = (flat.get_group(), [int(r) for r in flat.mesh.flatten().tolist()], dims.index(joined, coords))
    return out
