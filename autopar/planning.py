"""``autopar.plan``: the Plan and every rank's rewritten graphs, in one plain process.

No process group is created. The model is captured and analysed once; each tensor-parallel rank
lowers its own copy of that graph. Graphs are identical across dp replicas, so they are built once
per tensor-parallel rank and shared by every rank with that tp index. ``ranks=[r]`` builds only the
graphs rank ``r`` runs (one rank of a 1,024-rank plan); :meth:`PlanResult.rank_program` builds any
other rank's on demand. ``plan="auto"`` lets the planner (:mod:`autopar.planner`) choose the Plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError
from autopar.ir.stage_graph import StageGraph
from autopar.lowering import Captured, Lowered, capture_planned, lower_captured, resolve
from autopar.mesh import parse_mesh_shape
from autopar.ops.context_parallel.ring import RingAttention
from autopar.ops.context_parallel.ulysses import UlyssesAttention
from autopar.plan_model import Plan
from autopar.runtime.schedules.action import Schedule
from autopar.validation import check_arguments, checked_options

__all__ = ["plan", "PlanResult", "PlanSource", "RankGraphs", "rank_of", "coords_of"]


def rank_of(*, dp: int, pp: int, tp: int, shape, cp: int = 0) -> int:
    """Global rank of mesh coordinates (dp, cp, pp, tp) of a mesh ``shape`` (:meth:`ParallelDims.rank`)."""
    return shape.dims.rank(dp=dp, cp=cp, pp=pp, tp=tp)


@dataclass
class RankGraphs:
    """One rank's coordinates and its stage graphs."""

    rank: int
    coords: dict[str, int]
    stages: list[StageGraph]


@dataclass(frozen=True)
class PlanSource:
    """What :func:`plan` was given: the model and one global batch, to plan again at other sizes
    (:func:`autopar.memory.memory_formula`)."""

    model: nn.Module
    example_inputs: object
    loss_fn: object = None
    example_target: object = None


@dataclass
class PlanResult:
    """What :func:`plan` returns: the Plan, the schedule and every rank's graphs (or the ones asked for).

    ``lowered``: {tp rank: Lowered} of the tp ranks built in full. ``planner``: the planner's
    report (ranked candidates and reasons) when the Plan was chosen with ``plan="auto"``. ``source``:
    the model and batch it was planned from.
    """

    plan: Plan
    schedule: Schedule
    ranks: dict[int, RankGraphs]
    lowered: dict[int, Lowered]
    captured: Captured | None = None
    planner: object = None
    source: PlanSource | None = None
    _parts: dict = field(default_factory=dict, repr=False)  # (tp, pp) -> stages built for one rank

    def rank_program(self, rank: int) -> RankGraphs:
        """Rank ``rank``'s coordinates and stage graphs, built now if :func:`plan` did not build them."""
        if rank in self.ranks:
            return self.ranks[rank]
        shape = self.plan.mesh
        if not 0 <= rank < shape.world_size:
            raise PlanError(f"rank {rank} is outside the mesh {shape}", where="PlanResult.rank_program",
                            fix=f"pick a rank in 0..{shape.world_size - 1}")
        coords = coords_of(rank, shape)
        key = (coords["tp"], coords["pp"])
        if key not in self._parts:
            mine = _stages_of(self.schedule, {coords["pp"]})
            lowered = lower_captured(self.captured, tp_rank=coords["tp"], stages=mine)
            self._parts[key] = [s for s in lowered.stages if self.schedule.stage_to_rank[s.stage] == coords["pp"]]
        self.ranks[rank] = RankGraphs(rank, coords, self._parts[key])
        return self.ranks[rank]

    def graph(self, rank: int, stage: int | None = None) -> fx.GraphModule:
        """The rewritten graph of ``rank`` (its first stage unless ``stage`` is given)."""
        stages = self.rank_program(rank).stages
        return next(s.gm for s in stages if stage is None or s.stage == stage)

    def summary(self) -> str:
        return self.plan.summary()

    def describe_rank(self, rank: int) -> str:
        """A readable listing of one rank's program: coordinates, then each stage's code."""
        r = self.rank_program(rank)
        lines = [f"# rank {rank}: " + " ".join(f"{axis}={value}" for axis, value in r.coords.items())]
        for s in r.stages:
            lines.append(f"## stage {s.stage}: inputs {list(s.input_names)}, "
                         f"{len(s.param_names)} parameters, {len(s.recvs)} recv, {len(s.sends)} send")
            lines.append(s.gm.code.strip())
            for name, region in s.gm.named_children():  # recompute regions (passes/pipeline/recompute.py)
                if name.startswith("recompute_") and hasattr(region, "body"):
                    lines.append(f"### {name} ({region.mode} recompute)\n{region.body.code.strip()}")
            lines += [f"### {name} = {type(m).__name__}({m.extra_repr()})" for name, m in s.gm.named_modules()
                      if isinstance(m, (RingAttention, UlyssesAttention))]  # context parallel attention nodes
        lines.append(f"## schedule for pp rank {r.coords['pp']}: "
                     + " ".join(str(a) for a in self.schedule.actions[r.coords['pp']]))
        return "\n".join(lines)


def coords_of(rank: int, shape) -> dict[str, int]:
    """Mesh coordinates of global ``rank`` of a mesh ``shape`` (:meth:`ParallelDims.coords`)."""
    return shape.dims.coords(rank)


def _optimizer_kind(optimizer: str) -> str:
    from autopar.memory.states import OPTIMIZER_STATE
    if optimizer not in OPTIMIZER_STATE:
        raise PlanError(f"unknown optimizer kind {optimizer!r}", where="plan(optimizer=...)",
                        fix=f"use one of {', '.join(OPTIMIZER_STATE)}")
    return optimizer


def _stages_of(schedule: Schedule, pp_ranks) -> list[int]:
    return [s for s, q in enumerate(schedule.stage_to_rank) if q in pp_ranks]


def plan(model: nn.Module, mesh_shape=None, *, example_inputs, loss_fn=None, example_target=None,
         plan: Plan | str | None = None, ranks=None, cluster=None, optimizer: str = "adam", **options) -> PlanResult:
    """Plan ``model`` for a mesh of ``mesh_shape`` ({'dp':..,'pp':..,'tp':..} or (dp, pp, tp)).

    ``ranks``: build only these ranks' graphs (default: every rank). ``plan="auto"``: the planner
    chooses the Plan for ``cluster`` (a :class:`autopar.planner.Cluster` or a preset name);
    ``mesh_shape`` may then be a world size, a partial shape such as ``{"tp": 8}``, or None; it sizes
    memory for ``optimizer`` (``"sgd"``, ``"momentum"``, ``"adam"`` or ``"adamw"``, as
    :func:`autopar.memory.estimate_memory` reads it).
    """
    check_arguments(model, example_inputs=example_inputs, example_target=example_target, loss_fn=loss_fn, plan=plan,
                    mesh_shape=mesh_shape, where="plan")  # autopar/validation.py: every argument, before capture
    report = None
    if isinstance(plan, str):
        from autopar.planner.auto import choose_plan
        report = choose_plan(model, mesh_shape, example_inputs=example_inputs, loss_fn=loss_fn,
                             example_target=example_target, mode=plan, cluster=cluster, options=options,
                             optimizer=_optimizer_kind(optimizer))
        plan = report.plan
    shape = parse_mesh_shape(mesh_shape if plan is None else plan.mesh)
    opts = checked_options(options, mesh=shape, plan=plan, where="plan")
    # the Plan, resolved once (the planner's comes resolved): everything below reads it, not the options
    resolved = report.plan if report is not None else resolve(model, mesh=shape, example_inputs=example_inputs,
                                                               options=opts, plan=plan)
    cap = capture_planned(model, plan=resolved, pinned=plan is not None, example_inputs=example_inputs,
                          example_target=example_target, loss_fn=loss_fn, options=opts)
    schedule = cap.schedule
    wanted = range(shape.world_size) if ranks is None else sorted(set(ranks))
    for rank in wanted:
        if not 0 <= rank < shape.world_size:
            raise PlanError(f"rank {rank} is outside the mesh {shape}", where="plan(ranks=...)",
                            fix=f"pick ranks in 0..{shape.world_size - 1}")
    coords = {r: coords_of(r, shape) for r in wanted}
    tps = sorted({c["tp"] for c in coords.values()})
    pps = {c["pp"] for c in coords.values()}
    only = None if ranks is None else _stages_of(schedule, pps)
    lowered = {t: lower_captured(cap, tp_rank=t, stages=only) for t in tps}
    # with cp, each cp rank's graphs differ (the positions of its part of the sequence): lowered per (tp, cp)
    per_cp = {(t, c): lower_captured(cap, tp_rank=t, stages=only, cp_rank=c)
              for t, c in sorted({(c["tp"], c.get("cp", 0)) for c in coords.values()}) if c > 0}
    the_plan = lowered[tps[0]].plan
    result = PlanResult(plan=the_plan, schedule=schedule, ranks={}, lowered=lowered if ranks is None else {},
                        captured=cap, planner=report,
                        source=PlanSource(model, example_inputs, loss_fn, example_target))
    for rank, c in coords.items():
        mine = per_cp.get((c["tp"], c.get("cp", 0))) or lowered[c["tp"]]
        stages = [s for s in mine.stages if schedule.stage_to_rank[s.stage] == c["pp"]]
        result.ranks[rank] = RankGraphs(rank, c, stages)
    return result
