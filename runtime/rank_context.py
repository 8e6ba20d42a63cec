"""What one rank knows of its place in the job: its mesh coordinates and the process group of each axis.

:func:`autopar.mesh.mesh_info` reads a :class:`MeshInfo` off a DeviceMesh; the runtime reads it
and never the mesh itself, so a program can also be built over a hand-made ``MeshInfo`` (tests).

Example::

    >>> from autopar.plan_model import MeshShape
    >>> info = MeshInfo(MeshShape(dp=2, pp=2), rank=3, coords={"dp": 1, "pp": 1, "tp": 0},
    ...                 axis_ranks={"dp": [1, 3], "pp": [2, 3], "tp": [3]})
    >>> info.peer("pp", 0)
    2
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.plan_model import MeshShape

__all__ = ["MeshInfo"]


@dataclass
class MeshInfo:
    """This rank's view of the mesh."""

    shape: MeshShape
    rank: int
    coords: dict[str, int]
    groups: dict[str, object] = field(default_factory=dict)
    axis_ranks: dict[str, list[int]] = field(default_factory=dict)

    def peer(self, axis: str, index: int) -> int:
        """Global rank of the rank at ``index`` along ``axis`` sharing my other coordinates."""
        return self.axis_ranks[axis][index]
