"""The parts every program kind is built from, made once by :func:`build_parts`.

A rank's program (:class:`~autopar.runtime.execution.program.RankProgram`, the asynchronous
:class:`~autopar.runtime.execution.async_pipeline.AsyncProgram`, the DataParallel baseline's
:class:`~autopar.runtime.execution.data_parallel.DataParallelProgram`) is one way of running the same parts:

- this rank's stage graphs, holding their own weights (only this rank's ZeRO-3 shards; a meta-built
  model materialised piece by piece), their collectives and send/recv nodes bound to the rank's
  groups and p2p channel;
- the parameters (fp32 masters under mixed precision), the ZeRO-sharded optimizer over them;
- the index guard, the tied-weight aliases, and how many backward passes feed each parameter.

:class:`~autopar.runtime.execution.program_surface.ProgramSurface` adopts the parts; each program kind adds
only the step it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from autopar.ir.captured_graph import CapturedGraph
from autopar.ir.graph_names import user_name
from autopar.ir.meta_keys import PARAM, get_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.ir.stage_graph import StageGraph
from autopar.ops.collectives import bind_collectives
from autopar.ops.p2p import P2PChannel, P2PNode
from autopar.ops.zero3_ops import bind_zero3, shard_zero3_parameters
from autopar.plan_model import Plan
from autopar.runtime.execution.index_guard import IndexGuard, graph_has_bounds
from autopar.runtime.state.mixed_precision import MasterWeights
from autopar.runtime.state.param_groups import GroupTemplate
from autopar.runtime.execution.rank_context import RankContext
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.state.zero import ShardedOptimizer, stepped_here

__all__ = ["LoweredStages", "RankParts", "build_parts"]


class LoweredStages(Protocol):
    """What a program is built from: one tp rank's lowering (``autopar.lowering.Lowered`` is one)."""

    plan: Plan
    captured: CapturedGraph
    stages: list[StageGraph]
    param_shards: dict[str, ShardLayout]
    tp_partial_grads: tuple[str, ...]


@dataclass
class RankParts:
    """One rank's share of the compiled program, before any way of running it."""

    plan: Plan
    ctx: RankContext
    schedule: Schedule
    captured: CapturedGraph
    state_keys: tuple[str, ...]  # the single-device model's state_dict keys
    stages: dict[int, StageGraph]  # this rank's stages by index
    stage_ranks: dict[int, int]  # stage -> global rank running it
    channel: P2PChannel
    named_params: list[tuple[str, torch.nn.Parameter]]  # fp32 masters under mixed precision
    mixed: MasterWeights | None
    optimizer: ShardedOptimizer
    index_guard: IndexGuard
    aliases: dict[str, tuple[str, ...]]  # a tied weight's single-device names
    uses: dict[str, int]  # parameter -> stages of this rank reading it (backward passes per microbatch)
    zero3: tuple  # the Zero3Runtime of each stage that gathers its parameters
    loss_ranks: list[int]  # ranks whose stages compute the loss (two for Chimera: one per replica)
    tp_partial_grads: tuple[str, ...]  # sequence parallelism: gradients summed over tp


def _own_parameters(stages: list[StageGraph]) -> None:
    """Give the stage graphs their own copies of the weights (ties between local stages kept)."""
    copies: dict[int, torch.nn.Parameter] = {}
    for stage in stages:
        for target in stage.param_names:
            param = stage.gm.get_parameter(target)
            if id(param) not in copies:
                copies[id(param)] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            owner, _, leaf = target.rpartition(".")
            setattr(stage.gm.get_submodule(owner) if owner else stage.gm, leaf, copies[id(param)])


def _named_parameters(stages: dict[int, StageGraph]) -> list[tuple[str, torch.nn.Parameter]]:
    seen, named = set(), []
    for stage in stages.values():
        for target in stage.param_names:
            p = stage.gm.get_parameter(target)
            if id(p) not in seen:
                seen.add(id(p))
                named.append((user_name(target), p))
    return named


def _rank_stages(lowered: LoweredStages, *, ctx: RankContext, schedule: Schedule, materialize) -> list[StageGraph]:
    """This rank's stage graphs, holding their own weights (ZeRO-3: this rank's shards only)."""
    info = ctx.info
    mine = [s for s in lowered.stages if schedule.stage_to_rank[s.stage] == info.coords["pp"]]
    _own_parameters(mine)
    if lowered.plan.zero_stage == 3:  # ZeRO-3 graphs gather their parameters: keep only this rank's shards
        shard_zero3_parameters([s.gm for s in mine], dims=lowered.plan.dims, coords=info.coords)  # experts: edp
    if materialize is not None:  # a meta-built model: this rank's pieces, its experts (runtime/state/materialize.py)
        materialize([s.gm for s in mine])
    return mine


def _bind(mine: list[StageGraph], *, ctx: RankContext, channel: P2PChannel) -> tuple:
    """Point every collective and send/recv node at this rank's groups and channel; the ZeRO-3 runtimes."""
    info = ctx.info
    for stage in mine:
        bind_collectives(stage.gm, info.groups, ctx.guard)
        for module in stage.gm.modules():
            if isinstance(module, P2PNode):
                module.bind(channel)
    zero3 = [bind_zero3(s.gm, comm_log=ctx.comm_log) for s in mine]  # gathers over dp (experts: edp)
    return tuple(r for r in zero3 if r is not None)


def _uses(mine: list[StageGraph], named_params) -> dict[str, int]:
    """{parameter name: how many of this rank's stages read it} (by identity: tied weights count each stage)."""
    per_id: dict[int, int] = {}
    for stage in mine:
        for p in {id(stage.gm.get_parameter(t)) for t in stage.param_names}:
            per_id[p] = per_id.get(p, 0) + 1
    return {n: per_id[id(p)] for n, p in named_params}


def build_parts(*, lowered: LoweredStages, ctx: RankContext, schedule: Schedule, optimizer_factory,
                state_keys: tuple[str, ...], masters: dict | None = None, materialize=None,
                param_groups: GroupTemplate | None = None) -> RankParts:
    """This rank's parts of ``lowered`` (one tp rank's lowering: ``autopar.lowering.Lowered``); ``param_groups``:
    the optimizer factory's groups over the whole model (runtime/state/param_groups.py)."""
    plan, info = lowered.plan, ctx.info
    mine = _rank_stages(lowered, ctx=ctx, schedule=schedule, materialize=materialize)
    stages = {s.stage: s for s in mine}
    stage_ranks = {s: info.peer("pp", r) for s, r in enumerate(schedule.stage_to_rank)}
    channel = P2PChannel(rank=info.rank, stage_to_rank=stage_ranks, group=info.groups["pp"],
                         timeout_s=ctx.guard.timeout_s, device=info.device, guard=ctx.guard)
    zero3 = _bind(mine, ctx=ctx, channel=channel)
    named = _named_parameters(stages)
    uses = _uses(mine, named)  # by the compute parameters, before masters replace them
    stepped = stepped_here(named, zero_stage=plan.zero_stage, dims=plan.dims, coords=info.coords,
                           local=frozenset(plan.expert_params))  # ZeRO-1/2: masters only where a parameter is stepped
    mixed = MasterWeights(named, masters, stepped=stepped) if masters is not None else None
    if mixed is not None:  # bf16 graphs: the runtime steps fp32 masters (runtime/state/mixed_precision.py)
        named = mixed.named
    aliases = {user_name(n.target): tuple(user_name(a) for a in get_meta(n, PARAM).aliases)
               for s in lowered.stages for n in s.gm.graph.nodes
               if n.op == "get_attr" and get_meta(n, PARAM) is not None}
    optimizer = ShardedOptimizer(named, optimizer_factory, zero_stage=plan.zero_stage, dp=ctx.axis("dcp"),
                                 comm_log=ctx.comm_log, publish=mixed.publish if mixed is not None else None,
                                 synced=mixed.compute if mixed is not None else None,
                                 local=frozenset(plan.expert_params),
                                 # the ranks holding my experts (and other tokens: edp x cp)
                                 edp=ctx.axis("edcp") if "edp" in info.groups else None,
                                 template=param_groups, aliases=aliases)  # each tensor in its name's group
    return RankParts(
        plan=plan, ctx=ctx, schedule=schedule, captured=lowered.captured, state_keys=state_keys, stages=stages,
        stage_ranks=stage_ranks, channel=channel, named_params=named, mixed=mixed, optimizer=optimizer,
        # token ids and positions range-checked each step before the stages read them (runtime/execution/index_guard.py)
        index_guard=IndexGuard(stages, active=graph_has_bounds(lowered.captured.gm), device=info.device), aliases=aliases,
        uses=uses, zero3=zero3, loss_ranks=sorted({stage_ranks[s.stage] for s in lowered.stages if s.is_last}),
        tp_partial_grads=tuple(lowered.tp_partial_grads))
