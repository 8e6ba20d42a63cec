"""Expose what a split backward (B then W, as zero-bubble schedules ask) needs from a stage graph.

B computes only activation gradients; W computes weight gradients later. To make W cheap and
exact, every use of a parameter reads it through its own ``aten.alias`` node, and the stage graph
additionally returns, in order: the received values whose gradient goes back upstream, the outputs
of every parameter-consuming op (``uses``), and the aliases. The executor then
- in B: ``autograd.grad(roots, received + uses)`` keeps the gradient at each use's output and
  sends the received values' gradients upstream;
- in W: for each use, ``autograd.grad(use_output, alias, saved_grad)`` walks only that op's
  weight edge, so nothing is computed twice and a weight used twice (a tied embedding and LM head
  on one stage) gets each use's contribution once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.passes.pipeline_split import StageGraph
from autopar.runtime.p2p import RecvActivation

__all__ = ["WeightUses", "expose_weight_uses"]

aten = torch.ops.aten


@dataclass(frozen=True)
class WeightUses:
    """Layout of the extra outputs: how many primary outputs, received values and uses."""

    num_primary: int
    num_received: int
    params: tuple[str, ...]  # the parameter each use reads, in use order


def _primary_outputs(graph: fx.Graph) -> tuple[fx.Node, list]:
    out = next(n for n in graph.nodes if n.op == "output")
    value = out.args[0]
    return out, list(value) if isinstance(value, (tuple, list)) else [value]


def expose_weight_uses(stage: StageGraph) -> StageGraph:
    """Rewrite ``stage.gm`` in place for split backward; records the layout on ``stage.weight_uses``."""
    gm, graph = stage.gm, stage.gm.graph
    received = []
    for node in graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, RecvActivation) and module.requires_grad:
                module.grad_by_executor = True
                received.append(node)
    uses, aliases, params = [], [], []
    for node in list(graph.nodes):
        if node.op != "get_attr" or not isinstance(_fetch(gm, node.target), torch.nn.Parameter):
            continue
        for user in list(node.users):
            with graph.inserting_before(user):
                alias = graph.call_function(aten.alias.default, (node,))
            user.replace_input_with(node, alias)
            uses.append(user)
            aliases.append(alias)
            params.append(node.target)
    out, primary = _primary_outputs(graph)
    out.args = (tuple(primary + received + uses + aliases),)
    graph.lint()
    gm.recompile()
    stage.weight_uses = WeightUses(num_primary=len(primary), num_received=len(received), params=tuple(params))
    return stage


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
