"""The pipeline's stage graphs: one stage's program, what it reads and holds, and the edges between stages.

The pipeline split (:mod:`autopar.passes.pipeline.pipeline_split`) writes them; the runtime (executor, a rank's
parts) runs them. Every value computed on stage a and read on stage b > a is an :class:`Edge`: a
``send_<edge>`` node at the end of a, a ``recv_<edge>`` node at the start of b.

Example::

    >>> import torch
    >>> edge = Edge(0, "add_3", src=0, dst=1, shape=(4, 16), dtype=torch.float32, requires_grad=True)
    >>> (edge.src, edge.dst), edge.dims is None
    ((0, 1), True)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["StageGraph", "Edge"]


@dataclass(frozen=True)
class Edge:
    """A value produced on ``src`` and read on ``dst``."""

    index: int
    value: str
    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    dims: tuple | None = None  # the shape with SizeExprs where it follows a symbolic input dim


@dataclass
class StageGraph:
    """One stage's program, what it reads, and the parameters it holds."""

    stage: int
    gm: fx.GraphModule
    input_names: tuple[str, ...]
    param_names: tuple[str, ...]
    sends: list[Edge] = field(default_factory=list)
    recvs: list[Edge] = field(default_factory=list)
    is_last: bool = False
    weight_uses: object = None  # a WeightUses layout once the stage is prepared for split backward
    dynamic: tuple = ()  # the DynamicDims its graph runs any size of (ir/dynamic_shapes.py)
