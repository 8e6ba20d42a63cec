"""``autopar.plan``: the Plan and every rank's rewritten graphs, in one plain process.

No process group is created. Graphs are identical across dp replicas, so they are built once
per tensor-parallel rank and shared by every rank with that tp index.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn

from autopar.lowering import Lowered, lower
from autopar.mesh import parse_mesh_shape
from autopar.options import CompileOptions
from autopar.passes.pipeline_split import StageGraph
from autopar.plan_model import Plan
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.registry import build_schedule
from autopar.runtime.schedules.validator import validate

__all__ = ["plan", "PlanResult", "RankGraphs", "rank_of"]


def rank_of(*, dp: int, pp: int, tp: int, shape) -> int:
    """Global rank of mesh coordinates (dp, pp, tp), row-major as init_mesh lays them out."""
    return (dp * shape.pp + pp) * shape.tp + tp


@dataclass
class RankGraphs:
    """One rank's coordinates and its stage graphs."""

    rank: int
    coords: dict[str, int]
    stages: list[StageGraph]


@dataclass
class PlanResult:
    """What :func:`plan` returns: the Plan, the schedule and every rank's graphs."""

    plan: Plan
    schedule: Schedule
    ranks: dict[int, RankGraphs]
    lowered: dict[int, Lowered]

    def graph(self, rank: int, stage: int | None = None) -> fx.GraphModule:
        """The rewritten graph of ``rank`` (its first stage unless ``stage`` is given)."""
        stages = self.ranks[rank].stages
        return next(s.gm for s in stages if stage is None or s.stage == stage)

    def summary(self) -> str:
        return self.plan.summary()

    def describe_rank(self, rank: int) -> str:
        """A readable listing of one rank's program: coordinates, then each stage's code."""
        r = self.ranks[rank]
        lines = [f"# rank {rank}: dp={r.coords['dp']} pp={r.coords['pp']} tp={r.coords['tp']}"]
        for s in r.stages:
            lines.append(f"## stage {s.stage}: inputs {list(s.input_names)}, "
                         f"{len(s.param_names)} parameters, {len(s.recvs)} recv, {len(s.sends)} send")
            lines.append(s.gm.code.strip())
        lines.append(f"## schedule for pp rank {r.coords['pp']}: "
                     + " ".join(str(a) for a in self.schedule.actions[r.coords['pp']]))
        return "\n".join(lines)


def plan(model: nn.Module, mesh_shape, *, example_inputs, loss_fn=None, example_target=None,
         plan: Plan | None = None, **options) -> PlanResult:
    """Plan ``model`` for a mesh of ``mesh_shape`` ({'dp':..,'pp':..,'tp':..} or (dp, pp, tp))."""
    shape = parse_mesh_shape(mesh_shape if plan is None else plan.mesh)
    opts = CompileOptions(**options)
    lowered = {t: lower(model, mesh=shape, tp_rank=t, example_inputs=example_inputs,
                        example_target=example_target, loss_fn=loss_fn, options=opts, plan=plan)
               for t in range(shape.tp)}
    the_plan = lowered[0].plan
    p = the_plan.pipeline
    schedule = build_schedule(p.schedule, num_ranks=shape.pp, num_microbatches=p.num_microbatches,
                              num_virtual=p.num_virtual)
    validate(schedule)
    ranks = {}
    for d in range(shape.dp):
        for q in range(shape.pp):
            for t in range(shape.tp):
                rank = rank_of(dp=d, pp=q, tp=t, shape=shape)
                stages = [s for s in lowered[t].stages if schedule.stage_to_rank[s.stage] == q]
                ranks[rank] = RankGraphs(rank, {"dp": d, "pp": q, "tp": t}, stages)
    return PlanResult(plan=the_plan, schedule=schedule, ranks=ranks, lowered=lowered)
