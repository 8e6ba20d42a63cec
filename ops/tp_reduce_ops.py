"""The all-reduce of a reduction over a tensor-parallel shard, as a graph module.

A ``mean`` or ``sum`` over a dim that tensor parallelism shards (OLMo 2's q/k RMSNorm over every
head's features: ``mean(x ** 2, -1)``) computes, on each rank, the reduction of its own slice: a
partial sum. :class:`TpPartialSum` sits right after it: forward it all-reduces (sum) over tp and
multiplies by ``scale``, so every rank holds the reduction of the whole dim
(``passes/tp/tp_reduce_rules.py`` chooses ``scale``: ``1 / tp`` after a local mean, ``parts / tp`` after a
local sum of a dim whose pieces each sit on ``tp / parts`` ranks).

Backward is the identity (times ``scale``), Megatron's g: the result is read replicated, and where
the region reads it back on its shards the gradient is already summed over tp by the f there
(a :class:`~autopar.ops.tp_ops.TpGradSum`), so every rank's gradient of the result is the whole one;
what each rank's slice of the input gets is its own part of it.

Example (one process, world of one)::

    >>> reduce = TpPartialSum(axis="tp", size=1, scale=1.0)
    >>> reduce
    TpPartialSum(axis='tp', size=1, scale=1.0)
"""
from __future__ import annotations

from autopar.ops.collectives import Comm, GraphCollective, _ReduceFromRegion

__all__ = ["TpPartialSum"]


class TpPartialSum(GraphCollective):
    """Forward: all-reduce (sum) over tp, times ``scale``; backward: the identity, times ``scale``."""

    kind = "all_reduce(forward)"

    def __init__(self, *, axis: str, size: int, scale: float):
        super().__init__(axis=axis, size=size)
        self.scale = float(scale)

    def forward(self, x):
        out = _ReduceFromRegion.apply(x, self._require_group(), self.guard, self.purpose)
        return out * self.scale if self.scale != 1.0 else out

    def comm(self, in_bytes, out_bytes):
        return [Comm("forward", "all_reduce", out_bytes)]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, scale={self.scale}"

