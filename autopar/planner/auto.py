"""``plan="auto"``: profile the model, search, and hand the chosen Plan to the compiler.

:func:`choose_plan` is what :func:`autopar.plan` and :func:`autopar.compile` call. Options the
user set explicitly (``schedule=``, ``num_microbatches=``, ``zero_stage=``, ``recompute=``, ...)
pin that decision; a mesh shape pins the degrees it names (``{"tp": 8}`` pins only tp; a
``DeviceMesh`` pins all three). The result is a :class:`PlannerReport`: the Plan, the ranked
table, the rejected candidates with reasons, and why the first choice won.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from autopar.errors import PlanError
from autopar.options import CompileOptions, resolve_plan
from autopar.plan_model import MESH_AXES, MeshShape, Plan
from autopar.planner.cluster import Cluster, get_cluster, local_cluster
from autopar.planner.cost_model import CostModel, Estimate
from autopar.planner.precision import precision_note
from autopar.planner.profile import ModelProfile, profile_model
from autopar.planner.reasons import batch_warnings, explain, format_table
from autopar.planner.candidates import SearchSpace
from autopar.planner.search import SearchResult, search
from autopar.runtime.schedules.registry import default_stages_per_rank
from autopar.validation import _expert_parallel_problem

__all__ = ["PlannerReport", "choose_plan", "plan_for_compile", "optimizer_kind", "plan_from_estimate", "search_space"]

log = logging.getLogger(__name__)

@dataclass
class PlannerReport:
    """The planner's answer: the chosen Plan and how it was chosen."""

    plan: Plan
    best: Estimate
    result: SearchResult
    profile: ModelProfile
    cluster: Cluster
    reasons: list
    warnings: list = field(default_factory=list)  # the global batch too small for the plan, and the batch that is not

    def table(self, *, top: int = 10, rejected: int = 5) -> str:
        """The ranked candidates (est. step time, memory per rank) and some rejected ones with reasons."""
        return format_table(self.result, top=top, rejected=rejected)

    def critical_path(self, *, optimizer: str = "adam"):
        """The critical path of the chosen plan's pipeline under the planner's stage times (seconds)."""
        return CostModel(self.profile, self.cluster, optimizer=optimizer).critical_path(self.best.candidate)

    def summary(self) -> str:
        return "\n".join([f"planned for {self.result.world} ranks of {self.cluster.name} "
                          f"({self.cluster.device.name}, {self.cluster.device.memory_gb:g} GB), "
                          f"global batch {self.result.global_batch}",
                          *self.reasons, *self.warnings])

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()


def optimizer_kind(factory, *, named: bool = False) -> str:
    """The memory calculator's optimizer kind of an optimizer factory (``sgd``, ``momentum``, ``adam``);
    ``named``: the factory takes ``(name, parameter)`` pairs (``optimizer_params="named"``)."""
    if factory is None:
        return "adam"
    probe_param = torch.nn.Parameter(torch.zeros(1))
    probe = factory([("probe", probe_param)] if named else [probe_param])
    name = type(probe).__name__.lower()
    if name == "sgd":
        return "momentum" if any(g.get("momentum", 0) for g in probe.param_groups) else "sgd"
    return "adamw" if name == "adamw" else "adam"


def _pinned_degrees(mesh_shape, cluster: Cluster | None) -> tuple[int | None, dict]:
    """(world size or None, {axis: degree} pinned by the caller)."""
    if mesh_shape is None:
        return None, {}
    if isinstance(mesh_shape, int):
        return mesh_shape, {}
    if isinstance(mesh_shape, MeshShape):  # (a whole mesh pins cp too, 1 where it has no cp dim)
        return mesh_shape.world_size, {**mesh_shape.model_dump(), "cp": mesh_shape.cp}
    if isinstance(mesh_shape, (tuple, list)) and len(mesh_shape) == 3:
        shape = MeshShape(dp=mesh_shape[0], pp=mesh_shape[1], tp=mesh_shape[2])
        return shape.world_size, {**shape.model_dump(), "cp": 1}
    if isinstance(mesh_shape, dict):
        unknown = sorted(set(mesh_shape) - set(MESH_AXES) - {"world"})
        if unknown:
            raise PlanError(f"unknown mesh dim names {unknown}", where="mesh_shape",
                            fix=f"name mesh dims from {MESH_AXES} (and 'world')")
        world = mesh_shape.get("world")
        if world is None and set(mesh_shape) >= {"dp", "pp", "tp"}:
            world = mesh_shape["dp"] * mesh_shape["pp"] * mesh_shape["tp"] * mesh_shape.get("cp", 1)
        return world, {k: v for k, v in mesh_shape.items() if k in MESH_AXES}
    raise PlanError(f"cannot read mesh shape {mesh_shape!r} for plan='auto'", where="mesh_shape",
                    fix="pass a world size, {'tp': 8, 'world': 64}, a (dp, pp, tp) tuple or None")


def search_space(options: dict, pinned: dict) -> SearchSpace:
    """The search space left once the explicitly given options and mesh degrees are pinned."""
    space = SearchSpace(**{axis: (pinned[axis],) for axis in MESH_AXES if axis in pinned})
    if "schedule" in options:
        v = default_stages_per_rank(options["schedule"], options.get("num_virtual"))
        space = _replace(space, schedules=((options["schedule"], v),))
    elif options.get("num_virtual"):
        space = _replace(space, schedules=tuple((n, options["num_virtual"]) for n, v in space.schedules if v > 1))
    if options.get("num_virtual"):
        space = _replace(space, virtual=(options["num_virtual"],))
    if options.get("num_microbatches"):
        space = _replace(space, num_microbatches=(options["num_microbatches"],))
    if "zero_stage" in options:
        space = _replace(space, zero_stages=(options["zero_stage"],))
    if "recompute" in options:
        space = _replace(space, recompute=(options["recompute"],))
    if options.get("cp_strategy", "auto") != "auto":
        space = _replace(space, cp_strategy=options["cp_strategy"])
    if "expert_parallel" in options:
        space = _replace(space, expert_parallel=(options["expert_parallel"],))
    else:  # the options' own refusals of ep > 1 (autopar/validation.py), whatever the mesh
        probe = CompileOptions(**{**options, "expert_parallel": 2})
        problem = _expert_parallel_problem(probe, MeshShape(dp=2, tp=2))
        if problem:
            space = _replace(space, ep_refusal=f"{problem[0].replace('expert_parallel=2', 'expert_parallel')} "
                                               f"({problem[1]})")
    return space


def _replace(space: SearchSpace, **kw) -> SearchSpace:
    from dataclasses import replace
    return replace(space, **kw)


def plan_from_estimate(best: Estimate, profile: ModelProfile, *, options: CompileOptions) -> Plan:
    """The Plan the compiler lowers for the chosen candidate (it fills in shards and shared weights)."""
    c = best.candidate
    chosen = options.model_copy(update={"schedule": c.schedule, "num_microbatches": c.num_microbatches,
                                        "num_virtual": c.num_virtual, "zero_stage": c.zero_stage,
                                        "recompute": c.recompute, "precision": profile.precision,
                                        "expert_parallel": c.expert_parallel,
                                        **({"cp_strategy": c.cp_strategy} if c.cp > 1 else {})})
    plan = resolve_plan(chosen, given=None, mesh=MeshShape(dp=c.dp, pp=c.pp, tp=c.tp, cp=c.cp),
                        batch=profile.global_batch, model_name=profile.model_name,
                        num_parameters=profile.num_parameters)
    starts = tuple(profile.chunks[c.tp][i].unit for i in c.cuts)
    return Plan(**{**dict(plan), "pipeline": plan.pipeline.model_copy(update={"stage_starts": starts}),
                   "tp_regions": profile.regions.get(c.tp, ()) if c.tp > 1 else (),
                   # the experts the profile sharded over tp (a given Plan names them: lowering.py)
                   "param_shards": profile.expert_shards.get(c.tp, {}) if c.tp > 1 else {},
                   "vocab_parallel": profile.vocab.get(c.tp, ()) if c.tp > 1 else ()})


def choose_plan(model, mesh_shape=None, *, example_inputs, loss_fn, example_target, mode: str = "auto",
                cluster=None, options: dict | None = None, optimizer: str = "adam") -> PlannerReport:
    """Profile ``model``, search the plans for ``cluster`` and return the report of the fastest that fits."""
    if mode != "auto":
        raise PlanError(f"unknown plan mode {mode!r}", where="plan=", fix="pass plan='auto' or a Plan")
    own_loss = loss_fn is None and isinstance(example_inputs, Mapping) and "labels" in example_inputs
    if not own_loss and (loss_fn is None or example_target is None):
        raise PlanError("plan='auto' plans training and needs the loss", where="plan='auto'",
                        fix="pass loss_fn= and example_target=, or a dict batch with labels (the model's own loss)")
    options = dict(options or {})
    world, pinned = _pinned_degrees(mesh_shape, cluster)
    base = get_cluster(cluster) if cluster is not None else local_cluster()
    world = world or base.world_size
    sized = base.for_world(world)
    opts = CompileOptions(**options)  # (an unknown option or schedule is refused before the search space)
    space = search_space(options, pinned)
    tps = [t for t in range(1, sized.devices_per_node + 1)
           if sized.devices_per_node % t == 0 and world % t == 0 and (space.tp is None or t in space.tp)]
    profile = profile_model(model, example_inputs=example_inputs, loss_fn=loss_fn, example_target=example_target,
                            tp_degrees=tps, options=opts)
    result = search(profile, sized, world=world, space=space, optimizer=optimizer)
    best = result.best
    plan = plan_from_estimate(best, profile, options=opts)
    reasons = explain(result) + precision_note(result, space=space, optimizer=optimizer)
    report = PlannerReport(plan=plan, best=best, result=result, profile=profile, cluster=sized,
                           reasons=reasons, warnings=batch_warnings(result))
    log.info("planner: %s", report.reasons[0])
    for line in report.warnings:
        log.info("planner: %s", line)
    return report


def plan_for_compile(model, mesh, *, example_inputs, loss_fn, example_target, mode: str, cluster, optimizer,
                     options: dict):
    """(report, mesh) for :func:`autopar.compile`: a given DeviceMesh pins dp, pp and tp; None lets the
    planner choose them for the job's world size and builds the mesh (every rank plans alike)."""
    import os

    import torch.distributed as dist

    from autopar.mesh import init_mesh, mesh_info

    if mesh is None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        shape = world
    else:
        shape = mesh_info(mesh).shape
    report = choose_plan(model, shape, example_inputs=example_inputs, loss_fn=loss_fn,
                         example_target=example_target, mode=mode, cluster=cluster, options=options,
                         optimizer=optimizer_kind(optimizer, named=options.get("optimizer_params") == "named"))
    if mesh is None:
        m = report.plan.mesh
        mesh = init_mesh(dp=m.dp, pp=m.pp, tp=m.tp, cp=m.cp)
    return report, mesh
