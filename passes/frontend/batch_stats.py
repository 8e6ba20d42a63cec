"""Refuse what cannot be exact: batch statistics computed over part of the batch.

BatchNorm in training mode normalises by the mean and variance of the batch it sees, and updates
its running statistics (buffers) in forward. Under data parallelism each rank sees only its dp
slice, and under pipelining each forward sees one microbatch; the loss would then differ from one
device and the running statistics would diverge per rank. autopar does not approximate this: it
raises :class:`autopar.PlanError` naming the node and the module, and says how to make it exact.

With ``dp=1`` and one microbatch every forward sees the whole batch, and BatchNorm is exact on any
``pp`` and ``tp`` (tensor parallelism leaves convolutions and norms replicated).

Example::

    >>> import torch, torch.nn as nn
    >>> from autopar.passes.frontend.capture import capture
    >>> from autopar.passes.frontend.batch_stats import batch_statistics_nodes
    >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    >>> gm = capture(net, (torch.randn(2, 3, 8, 8),)).gm
    >>> [n.name for n in batch_statistics_nodes(gm)]
    ['batch_norm']
"""
from __future__ import annotations

import torch.fx as fx

from autopar.errors import PlanError
from autopar.passes.lowering_state import LoweringState

__all__ = ["batch_statistics_nodes", "check_batch_statistics"]


def _training_flag(node: fx.Node) -> bool:
    """The value of a batch-norm op's ``training`` argument (True for the always-updating variants)."""
    name = getattr(node.target, "__name__", str(node.target))
    if "with_update" in name:
        return True
    if "no_update" in name or "no_training" in name:
        return False
    schema = getattr(node.target, "_schema", None)
    for index, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "training":
            if index < len(node.args):
                return bool(node.args[index])
            return bool(node.kwargs.get("training", arg.default_value))
    return False


def batch_statistics_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that normalise by statistics of the batch (batch norm in training mode)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)
            and _training_flag(n)]


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root>"
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("model.")


def check_batch_statistics(st: LoweringState) -> LoweringState:
    """A check pass: PlanError when a batch-statistics op of ``st.gm`` would see less than the whole global batch."""
    dp, num_microbatches = st.plan.mesh.dp, st.plan.pipeline.num_microbatches
    nodes = batch_statistics_nodes(st.gm)
    if not nodes or dp * num_microbatches == 1:
        return st
    node = nodes[0]
    others = f" (and {len(nodes) - 1} more)" if len(nodes) > 1 else ""
    raise PlanError(
        f"BatchNorm in training mode normalises by the statistics of the batch it sees, but with dp={dp} "
        f"and {num_microbatches} microbatches each forward sees 1/{dp * num_microbatches} of the batch: "
        f"the loss would differ from one device and the running statistics would diverge per rank",
        where=f"node {node.name} (module {_module_path(node)}){others}",
        fix="compile with num_microbatches=1 (and schedule='gpipe' when pp > 1) on a mesh with dp=1 (pp and "
            "tp are exact then), or freeze "
            "the statistics with .eval() on the BatchNorm modules, or use GroupNorm/LayerNorm instead")
