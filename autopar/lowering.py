"""From a model and a mesh to one rank's stage graphs: the compiler's passes, in order.

Both entry points share this: :func:`autopar.compile` lowers for its own rank inside torchrun,
:func:`autopar.plan` lowers every (tp rank) in a plain process. The pipeline of passes is written
out once, in :func:`_pass_steps`, one line per pass with the reason it runs there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError
from autopar.options import CompileOptions
from autopar.passes.annotate import annotate
from autopar.passes.capture import MODEL_PREFIX, CapturedGraph, capture
from autopar.passes.meta_keys import MODULE, get_meta
from autopar.passes.partition import assign_stages
from autopar.passes.pass_manager import PassStep, run_passes
from autopar.passes.pipeline_split import StageGraph, split_pipeline
from autopar.passes.tensor_parallel import ShardSpec, shard_tensor_parallel
from autopar.passes.tp_regions import TpRegion, find_tp_regions
from autopar.passes.weight_grad_split import expose_weight_uses
from autopar.plan_model import MeshShape, ParamShard, PipelinePlan, Plan, TpRegionPlan

__all__ = ["Lowered", "lower", "choose_microbatches", "user_name"]

log = logging.getLogger(__name__)


@dataclass
class Lowered:
    """The result of lowering for one tp rank: the Plan, the captured graph and every stage graph."""

    plan: Plan
    captured: CapturedGraph
    stages: list[StageGraph]
    param_shards: dict[str, ShardSpec]


def user_name(graph_name: str) -> str:
    """A graph attribute name (``model.blocks.0.mlp.fc.weight``) as the user's model names it."""
    prefix = MODEL_PREFIX + "."
    return graph_name[len(prefix):] if graph_name.startswith(prefix) else graph_name


def choose_microbatches(*, batch: int, dp: int, pp: int, requested: int | None) -> int:
    """The microbatch count: the requested one, or 2·pp (else pp, else 1) when it divides the batch."""
    if batch % dp != 0:
        raise PlanError(f"batch size {batch} is not divisible by dp={dp}",
                        where="example_inputs, dim 0", fix="make the global batch a multiple of dp")
    local = batch // dp
    if requested is not None:
        if local % requested != 0:
            raise PlanError(f"batch size {batch} is not divisible by microbatches={requested} x dp={dp}",
                            where="example_inputs, dim 0",
                            fix=f"use a batch that is a multiple of {requested * dp} or change num_microbatches")
        return requested
    for m in (2 * pp, pp, 1):
        if local % m == 0:
            return m
    return 1


def _pass_steps(*, mesh: MeshShape, tp_rank: int, options: CompileOptions, regions, stage_starts, found):
    """The pipeline of transforms after capture and analysis, in order."""

    def shard(gm: fx.GraphModule) -> fx.GraphModule:
        gm, specs = shard_tensor_parallel(gm, tp_size=mesh.tp, tp_rank=tp_rank, regions=regions)
        found["specs"] = specs
        return gm

    def stages(gm: fx.GraphModule) -> fx.GraphModule:
        gm, starts = assign_stages(gm, num_stages=mesh.pp * options.num_virtual, stage_starts=stage_starts)
        found["starts"] = starts
        return gm

    steps = []
    if mesh.tp > 1:
        # shard before the split: a region's column and row linears then always share a stage
        steps.append(PassStep("shard_tensor_parallel", shard, "Megatron f/g around each region"))
    # cut after sharding, so stage costs are measured on the shards this rank runs
    steps.append(PassStep("assign_stages", stages, "cost-balanced stage cuts at block boundaries"))
    return tuple(steps)


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Virtual stages per pp rank: as requested, else 2 for the looping schedules, else 1."""
    if requested is not None:
        return requested
    return 2 if schedule in ("interleaved_1f1b", "looped_bfs", "zb_v") else 1


def _splits_backward(schedule: str) -> bool:
    return schedule in ("zb_h1", "zb_h2", "zb_v")


def _slice_batch(tensors: tuple, size: int) -> tuple:
    return tuple(t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in tensors)


def _region_plan(region: TpRegion) -> TpRegionPlan:
    def paths(nodes):
        return tuple(user_name(get_meta(n, MODULE).path) for n in nodes)
    return TpRegionPlan(columns=paths(region.columns), rows=paths(region.rows))


def _select_regions(gm: fx.GraphModule, *, mesh: MeshShape, options: CompileOptions, plan: Plan | None):
    if mesh.tp == 1 or not options.tensor_parallel:
        return []
    regions = find_tp_regions(gm)
    if plan is None:
        return regions
    wanted = {r.columns for r in plan.tp_regions}
    return [r for r in regions if _region_plan(r).columns in wanted]


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def lower(model: nn.Module, *, mesh: MeshShape, tp_rank: int, example_inputs: tuple,
          example_target=None, loss_fn=None, options: CompileOptions, plan: Plan | None = None) -> Lowered:
    """Capture, analyse and transform ``model`` into the stage graphs of tensor-parallel rank ``tp_rank``."""
    if plan is not None:
        options = options.model_copy(update={"schedule": plan.pipeline.schedule,
                                             "num_microbatches": plan.pipeline.num_microbatches,
                                             "num_virtual": plan.pipeline.num_virtual,
                                             "zero_stage": plan.zero_stage, "capture": plan.capture})
    options = options.model_copy(update={"num_virtual": stages_per_rank(options.schedule, options.num_virtual)})
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    batch = example_inputs[0].shape[0]
    m = choose_microbatches(batch=batch, dp=mesh.dp, pp=mesh.pp, requested=options.num_microbatches)
    mb = batch // (mesh.dp * m)
    args = _slice_batch(example_inputs, mb)
    target = _slice_batch((example_target,), mb)[0] if example_target is not None else None
    if _is_meta(model):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        target = target.to("meta") if isinstance(target, torch.Tensor) else target
    captured = capture(model, args, loss_fn=loss_fn, example_target=target, mode=options.capture)
    all_args = args + ((target,) if loss_fn is not None else ())
    gm = annotate(captured.gm, example_inputs=all_args, model=model)
    regions = _select_regions(gm, mesh=mesh, options=options, plan=plan)
    found: dict = {"specs": {}, "starts": []}
    starts = list(plan.pipeline.stage_starts) if plan is not None and plan.pipeline.stage_starts else None
    steps = _pass_steps(mesh=mesh, tp_rank=tp_rank, options=options, regions=regions,
                        stage_starts=[MODEL_PREFIX + "." + s for s in starts] if starts else None,
                        found=found)
    gm = run_passes(gm, steps, example_inputs=all_args)
    stages = split_pipeline(gm, num_stages=mesh.pp * options.num_virtual)
    if loss_fn is not None and _splits_backward(options.schedule):
        # zero-bubble schedules run B and W apart: every weight use gets its own alias and output
        stages = [expose_weight_uses(s) for s in stages]
    shared = {user_name(name): tuple(s.stage for s in stages if name in s.param_names)
              for name in {n for s in stages for n in s.param_names}}
    new_plan = Plan(
        model_name=type(model).__name__, mesh=mesh, global_batch_size=batch,
        pipeline=PipelinePlan(schedule=options.schedule, num_microbatches=m, num_virtual=options.num_virtual,
                              stage_starts=tuple(user_name(s) for s in found["starts"])),
        tp_regions=tuple(_region_plan(r) for r in regions),
        param_shards={user_name(k): ParamShard(dim=v.dim, chunks=v.chunks) for k, v in found["specs"].items()},
        shared_params={k: v for k, v in shared.items() if len(v) > 1},
        zero_stage=options.zero_stage, capture=options.capture,
        num_parameters=sum(p.numel() for p in model.parameters()),
    )
    return Lowered(plan=new_plan, captured=captured, stages=stages, param_shards=found["specs"])
