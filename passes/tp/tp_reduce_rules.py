"""Reductions over a tensor-parallel shard: each rank's partial sum, all-reduced over tp.

A ``mean`` or ``sum`` that reduces over the sharded dim (OLMo 2's q/k RMSNorm over every head's
features, before the head split: ``x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps) * w``) runs on
each rank's slice and gives a partial result: its placement is ``P``, as a row linear's output is.
The transform (:func:`insert_partial_sums`) puts a :class:`~autopar.ops.tp_reduce_ops.TpPartialSum`
right after it: an all-reduce (sum) over tp, scaled so that every rank holds the reduction of the whole
dim (a mean divides by the full size: ``1 / tp`` times the sum of the local means; a dim whose pieces
each sit on ``tp / parts`` ranks, fewer kv heads than tp, counts each piece ``tp / parts`` times:
``parts / tp``). What follows (``+ eps``, ``rsqrt``) runs replicated outside the region; where the
region reads it back on its shards (``x * rsqrt``, broadcast over the sharded dim) the solver puts an f
(:class:`~autopar.ops.tp_ops.TpGradSum`: each rank's gradient of it is its slice's part), so the
all-reduce's backward is the identity, Megatron's g. A region op that reads the reduction itself on the
shards (a hand-written LayerNorm's ``x - x.mean(-1, keepdim=True)``) reads it through such an f too. The norm's own 1-D weight multiplies the sharded
features: it is sliced per rank, as a per-head norm's is.

:func:`partial_sum_rule` wraps the placement rule of a reduction (:data:`autopar.passes.tp.tp_rules.RULES`
registers it for ``mean`` and ``sum``): the wrapped rule places a reduction that keeps the sharded dim.

Example::

    >>> import torch
    >>> from autopar.passes.frontend.capture import capture
    >>> class QNorm(torch.nn.Module):   # an RMSNorm over every head's features, then the heads
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.o = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    ...         self.w = torch.nn.Parameter(torch.ones(8))
    ...     def forward(self, x):
    ...         q = self.q(x)
    ...         q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
    ...         return self.o(q.view(2, 4, 2, 4).softmax(-1).view(2, 4, 8))
    >>> from autopar.passes.frontend.annotate import annotate
    >>> x = torch.randn(2, 4, 8)
    >>> gm = annotate(capture(QNorm(), (x,)).gm, example_inputs=(x,))
    >>> from autopar.passes.tp.tp_regions import find_tp_regions
    >>> [n.name for n in partial_reductions(find_tp_regions(gm, tp_size=2)[0])]
    ['mean']
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from autopar.ir.meta_keys import MODULE, TENSOR, TP_PLACEMENT, Placement, get_meta, set_meta
from autopar.ops.tp_ops import TpGradSum
from autopar.ops.tp_reduce_ops import TpPartialSum
from autopar.passes.tp.tp_errors import NoRule

__all__ = ["REDUCTIONS", "PARTIAL", "partial_sum_rule", "read_replicated", "partial_reductions",
           "insert_partial_sums"]

REDUCTIONS = ("mean", "sum")
PARTIAL = Placement("P")


def _name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))


def _reduced_dims(node: fx.Node) -> list[int]:
    """The dims ``node`` (``mean``/``sum``, with or without a dim list) reduces, non-negative."""
    rank = len(get_meta(node.args[0], TENSOR).shape)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(rank))
    return [d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


def partial_sum_rule(fallback: Callable) -> Callable:
    """A reduction's rule: ``fallback``'s when the sharded dim is kept, else a partial sum (``P``)."""

    def rule(node: fx.Node, placed: dict):
        src = node.args[0]
        p = placed.get(src)
        info = get_meta(src, TENSOR) if isinstance(src, fx.Node) else None
        if p is None or p.kind != "S" or info is None or info.shape is None or p.dim not in _reduced_dims(node):
            return fallback(node, placed)
        if p.blocks or p.inner is not None:
            raise NoRule(f"{node.name} reduces over the unequal blocks of a fused projection or a kv-head broadcast")
        return PARTIAL, {src: p}

    rule.__name__ = f"partial_sum_or_{getattr(fallback, '__name__', 'rule')}"
    rule.__doc__ = partial_sum_rule.__doc__
    return rule


def read_replicated(node: fx.Node, have: Placement, need: Placement) -> bool:
    """Whether a region op may read ``node`` (placed ``have``) as ``need``: a partial reduction read
    replicated, as it is once all-reduced (``x - x.mean(-1, keepdim=True)`` on the shards)."""
    return have.kind == "P" and need.kind == "R" and node.op == "call_function" and _name(node) in REDUCTIONS


def partial_reductions(region) -> list[fx.Node]:
    """The region's reductions over its sharded dim (placed ``P``, not its row linears), in graph order."""
    rows = set(region.rows)
    return [n for n, p in region.placements.items() if p.kind == "P" and n not in rows
            and n.op == "call_function" and _name(n) in REDUCTIONS]


def _scale(node: fx.Node, p: Placement, tp_size: int) -> float:
    """What the all-reduce of the local results is multiplied by to give the whole dim's."""
    if _name(node) == "mean":
        return 1.0 / tp_size  # each local mean divides by the local size, (parts or tp) times too small
    return p.layout.ways(tp_size) / tp_size  # each piece held by tp / ways ranks is summed that often


def _fresh(gm: fx.GraphModule, prefix: str) -> str:
    i = 0
    while hasattr(gm, f"{prefix}_{i}"):
        i += 1
    return f"{prefix}_{i}"


def insert_partial_sums(gm: fx.GraphModule, region, tp_size: int) -> list[fx.Node]:
    """After each of the region's partial reductions, its :class:`TpPartialSum`; returns the new nodes."""
    out = []
    for node in partial_reductions(region):
        name = _fresh(gm, "tp_partial_sum")
        gm.add_submodule(name, TpPartialSum(axis="tp", size=tp_size,
                                            scale=_scale(node, region.placements[node.args[0]], tp_size)))
        users = list(node.users)
        with gm.graph.inserting_after(node):
            summed = gm.graph.call_module(name, (node,))
        summed.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", MODULE, TENSOR)})
        set_meta(summed, TP_PLACEMENT, Placement("R"))
        for user in users:
            user.replace_input_with(node, summed)
        inside = [u for u in users if u in region.placements]  # read on the shards directly: through an f
        if inside:
            name = _fresh(gm, "tp_partial_grad_sum")
            gm.add_submodule(name, TpGradSum(axis="tp", size=tp_size))
            with gm.graph.inserting_after(summed):
                f = gm.graph.call_module(name, (summed,))
            f.meta.update({k: v for k, v in summed.meta.items() if k in ("nn_module_stack", MODULE, TENSOR)})
            for user in inside:
                user.replace_input_with(summed, f)
        out.append(summed)
    return out
