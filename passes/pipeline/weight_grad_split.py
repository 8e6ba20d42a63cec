"""Expose what a split backward (B then W, as zero-bubble schedules ask) needs from a stage graph.

B computes only activation gradients; W computes weight gradients later. To make W cheap and
exact, every use of a parameter reads it through its own ``aten.alias`` node, and the stage graph
additionally returns, in order: the received values whose gradient goes back upstream, the outputs
of every parameter-consuming op (``uses``), and the aliases. The executor then
- in B: ``autograd.grad(roots, received + uses)`` keeps the gradient at each use's output and
  sends the received values' gradients upstream;
- in W: ``autograd.grad(use_outputs, aliases, saved_grads)`` walks only the uses' weight edges,
  so nothing is computed twice and a weight used twice (a tied embedding and LM head on one stage)
  gets each use's contribution once.

W batches uses into one ``autograd.grad`` call per *group* (``WeightUses.groups``): uses of one
level, where a use's level is one more than the highest level of the uses it depends on. No use of
a group is then an ancestor of another, so no gradient fed in at one use's output can reach another
use's alias: each alias receives exactly its own use's vjp, as with one call per use, and the
engine computes no activation gradient (an activation edge is needed only on a path to a listed
alias, which would pass through an ancestor use in the group). A linear's weight and bias (two
uses of one node) always share a group. A GPT block has six levels (ln_1, qkv, proj, ln_2, fc,
proj), so a 4-block stage makes about 26 engine calls per W instead of 51; q/k/v or gate/up
projections that read one input share a level.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir.stage_graph import StageGraph
from autopar.ops.p2p import RecvActivation
from autopar.passes.lowering_state import LoweringState

__all__ = ["WeightUses", "expose_weight_uses", "expose_stage_weight_uses", "use_groups",
           "check_split_backward_recompute"]


def check_split_backward_recompute(modes: tuple[str, ...], *, schedule: str) -> None:
    """Refuse selective recomputation on a split-backward schedule.

    Selective recompute is torch's selective activation checkpointing, whose cache of stored op
    outputs is consumed by the first backward through a region; split backward walks each region
    twice (B, then W), so W would fail inside the step (torch: "Trying to backward an extra time").
    Full recomputation recomputes again on the second walk and works.
    """
    bad = [i for i, mode in enumerate(modes) if mode == "selective"]
    if bad:
        raise PlanError(f"recompute='selective' does not combine with the split-backward schedule {schedule!r}: "
                        f"its W action walks each recomputed region a second time, which torch's selective "
                        f"activation checkpointing does not allow",
                        where=f"compile(schedule={schedule!r}, recompute=...), stage(s) {bad}",
                        fix="use recompute='full' or 'none' with this schedule, or schedule='1f1b' / "
                            "'interleaved_1f1b' with selective recompute")

aten = torch.ops.aten


@dataclass(frozen=True)
class WeightUses:
    """Layout of the extra outputs: how many primary outputs, received values and uses."""

    num_primary: int
    num_received: int
    params: tuple[str, ...]  # the parameter each use reads, in use order
    groups: tuple[tuple[int, ...], ...]  # use positions W differentiates in one call, by level


def use_groups(graph: fx.Graph, uses: list[fx.Node]) -> tuple[tuple[int, ...], ...]:
    """Positions of ``uses`` grouped by level; no use in a group depends on another of its group."""
    is_use = set(uses)
    above: dict[fx.Node, int] = {}  # the highest level of a use at or upstream of each node; -1: none
    for node in graph.nodes:  # topological order
        highest = max((above[a] for a in node.all_input_nodes), default=-1)
        above[node] = highest + 1 if node in is_use else highest
    by_level: dict[int, list[int]] = {}
    for position, use in enumerate(uses):
        by_level.setdefault(above[use], []).append(position)
    return tuple(tuple(by_level[level]) for level in sorted(by_level))


def _primary_outputs(graph: fx.Graph) -> tuple[fx.Node, list]:
    out = next(n for n in graph.nodes if n.op == "output")
    value = out.args[0]
    return out, list(value) if isinstance(value, (tuple, list)) else [value]


def expose_weight_uses(st: LoweringState) -> LoweringState:
    """Every stage graph rewritten for split backward (:func:`expose_stage_weight_uses`)."""
    return dataclasses.replace(st, stages=tuple(expose_stage_weight_uses(g) for g in st.stages))


def expose_stage_weight_uses(stage: StageGraph) -> StageGraph:
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
    stage.weight_uses = WeightUses(num_primary=len(primary), num_received=len(received), params=tuple(params),
                                   groups=use_groups(graph, uses))
    return stage


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
