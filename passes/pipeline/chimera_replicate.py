"""Chimera's stage replication: the stage graphs of a second model replica, and where its losses end.

The schedule (:mod:`autopar.runtime.schedules.chimera`) numbers the down replica's stages
``0 .. P-1`` and the up replica's ``P .. 2P-1`` (stage ``P + k`` runs part ``k``).
:func:`replicate_stages` (the lowering's pass, the schedule family's replicas) builds the up replica's graphs from the down replica's: the same graph
code and the same weight objects (so a rank that holds both replicas of a part keeps one copy
and accumulates both gradients in it), with each send/recv re-addressed to the replica's stages.
It runs after the pipeline split. Lowering then lists every weight as held by two stages, and the
runtime sums the two replicas' gradients of each part after the backward (an exchange between the
two ranks holding them, :func:`autopar.runtime.state.grad_sync.sum_shared_gradients`), so both copies
stay equal.
::

    stages = replicas(split_graph(gm, num_stages=P), num_replicas=2)   # 2P stage graphs
"""
from __future__ import annotations

import copy
import dataclasses

import torch.fx as fx

from autopar.ir.stage_graph import StageGraph
from autopar.ops.p2p import RecvActivation, SendActivation
from autopar.passes.lowering_state import LoweringState
from autopar.runtime.schedules.registry import family

__all__ = ["replicate_stages", "replicas", "loss_stages"]


def _shifted_graph(stage: StageGraph, offset: int) -> fx.GraphModule:
    """``stage.gm``'s code over the same weights, its p2p modules re-addressed ``offset`` stages on."""
    gm = stage.gm
    graph = copy.deepcopy(gm.graph)
    attrs: dict[str, object] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            attrs[node.target] = _fetch(gm, node.target)
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, (SendActivation, RecvActivation)):
                module = copy.copy(module)
                module._modules = dict(module._modules)
                module.src_stage, module.dst_stage = module.src_stage + offset, module.dst_stage + offset
                module.channel = None
            attrs[node.target] = module
    return fx.GraphModule(attrs, graph, class_name=f"Stage{stage.stage + offset}")


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def replicate_stages(st: LoweringState) -> LoweringState:
    """``stages`` followed by the stage graphs of every other model replica the Plan's schedule family runs."""
    num_replicas = family(st.plan.pipeline.schedule).replicas
    return dataclasses.replace(st, stages=tuple(replicas(list(st.stages), num_replicas=num_replicas)))


def replicas(stages: list[StageGraph], *, num_replicas: int) -> list[StageGraph]:
    """``stages`` (one replica, parts ``0 .. P-1``) followed by ``num_replicas - 1`` re-addressed copies."""
    parts = len(stages)
    result = list(stages)
    for replica in range(1, num_replicas):
        offset = replica * parts
        for stage in stages:
            shift = lambda edges: [dataclasses.replace(e, src=e.src + offset, dst=e.dst + offset)  # noqa: E731
                                   for e in edges]
            result.append(dataclasses.replace(stage, stage=stage.stage + offset, gm=_shifted_graph(stage, offset),
                                              sends=shift(stage.sends), recvs=shift(stage.recvs)))
    return result


def loss_stages(stages: list[StageGraph]) -> list[int]:
    """The stages that compute the loss: the last part of every replica."""
    return [s.stage for s in stages if s.is_last]
