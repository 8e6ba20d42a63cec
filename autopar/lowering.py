"""From a model and a mesh to one rank's stage graphs: the compiler's passes, in order.

Both entry points share this: :func:`autopar.compile` lowers for its own rank inside torchrun,
:func:`autopar.plan` lowers every (tp rank) in a plain process. The pipeline of passes is written
out once, in :func:`_pass_steps`, one line per pass with the reason it runs there.
"""
from __future__ import annotations

import logging
from copy import deepcopy
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError
from autopar.options import CompileOptions
from autopar.passes.annotate import annotate
from autopar.passes.batch_stats import check_batch_statistics
from autopar.passes.block_template import BlockTemplate, capture_blocks, find_block_template
from autopar.passes.capture import MODEL_PREFIX, CapturedGraph, capture
from autopar.passes.meta_keys import MODULE, PARAM, STAGE, get_meta
from autopar.passes.moe_aux import sync_router_statistics
from autopar.passes.moe_detect import find_moe_layers
from autopar.passes.moe_expert_parallel import shard_experts
from autopar.passes.partition import assign_stages
from autopar.passes.pass_manager import PassStep, run_passes
from autopar.passes.pipeline_split import StageGraph, split_pipeline
from autopar.passes.recompute import recompute_modes, recompute_stage
from autopar.passes.sequence_parallel import shard_sequence_parallel
from autopar.passes.tensor_parallel import ShardSpec, shard_tensor_parallel
from autopar.passes.tp_random import fork_sharded_random, is_random
from autopar.passes.static_shapes import check_static_shapes
from autopar.passes.tp_coverage import warn_unsharded_matmuls
from autopar.passes.tp_regions import TpRegion, find_tp_regions
from autopar.passes.vocab_parallel import VocabParallel, find_vocab_parallel, shard_vocab_parallel
from autopar.passes.weight_grad_split import check_split_backward_recompute, expose_weight_uses
from autopar.passes.zero3 import check_zero3, shard_parameters_zero3
from autopar.runtime.mixed_precision import low_precision_copy
from autopar.plan_model import MeshShape, ParamShard, PipelinePlan, Plan, TpRegionPlan
from autopar.runtime.chimera import replicate_stages
from autopar.runtime.schedules.registry import build_schedule, default_stages_per_rank, splits_backward
from autopar.validation import check_captured

__all__ = ["Lowered", "Captured", "lower", "capture_and_annotate", "shard_captured", "lower_captured", "choose_microbatches",
           "user_name", "batch_inputs", "LABELS"]

log = logging.getLogger(__name__)


@dataclass
class Lowered:
    """The result of lowering for one tp rank: the Plan, the captured graph and every stage graph."""

    plan: Plan
    captured: CapturedGraph
    stages: list[StageGraph]
    param_shards: dict[str, ShardSpec]
    tp_partial_grads: tuple[str, ...] = ()  # replicated params read on sequence shards: grads summed over tp


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


def _pass_steps(*, mesh: MeshShape, tp_rank: int, options: CompileOptions, regions, stage_starts, found,
                vocab: VocabParallel | None = None, assign: bool = True, random_ops: bool = True, ep_rank: int = 0,
                moe: bool = False):
    """The pipeline of transforms after capture and analysis, in order."""

    def router_statistics(gm: fx.GraphModule) -> fx.GraphModule:
        return sync_router_statistics(gm, dp=mesh.dp)[0]

    def experts(gm: fx.GraphModule) -> fx.GraphModule:
        gm, found["experts"] = shard_experts(gm, ep=options.expert_parallel, ep_rank=ep_rank,
                                             capacity_factor=options.moe_capacity_factor)
        return gm

    def shard_vocab(gm: fx.GraphModule) -> fx.GraphModule:
        gm, specs = shard_vocab_parallel(gm, vocab, tp_size=mesh.tp, tp_rank=tp_rank)
        found["specs"].update(specs)
        return gm

    def shard_sequence(gm: fx.GraphModule) -> fx.GraphModule:
        gm, found["partial_grads"] = shard_sequence_parallel(
            gm, tp_size=mesh.tp, regather=not _splits_backward(options.schedule))
        return gm

    def fork_random(gm: fx.GraphModule) -> fx.GraphModule:
        return fork_sharded_random(gm, seed=torch.initial_seed(), tp_rank=tp_rank)

    def shard(gm: fx.GraphModule) -> fx.GraphModule:
        gm, specs = shard_tensor_parallel(gm, tp_size=mesh.tp, tp_rank=tp_rank, regions=regions)
        found["specs"] = specs
        return gm

    def stages(gm: fx.GraphModule) -> fx.GraphModule:
        gm, starts = assign_stages(gm, num_stages=mesh.pp * options.num_virtual, stage_starts=stage_starts)
        found["starts"] = starts
        return gm

    steps = []
    if mesh.dp > 1 and moe:  # MoE routers' load-balancing statistics over the global batch
        steps.append(PassStep("sync_router_statistics", router_statistics, "the aux loss as one device computes it"))
    if options.expert_parallel > 1:  # first: the tp and pp passes then see the dispatch/combine nodes
        steps.append(PassStep("shard_experts", experts, "MoE experts over ep ranks, all-to-all dispatch/combine"))
    if mesh.tp > 1:
        # shard before the split: a region's column and row linears then always share a stage
        steps.append(PassStep("shard_tensor_parallel", shard, "Megatron f/g around each region"))
        if vocab:
            steps.append(PassStep("shard_vocab_parallel", shard_vocab,
                                  "embedding, LM head and loss on vocabulary shards; the head's f joins the others"))
        if options.sequence_parallel:
            steps.append(PassStep("shard_sequence_parallel", shard_sequence,
                                  "needs every f and g in place: they become all-gathers and reduce-scatters"))
        if random_ops:
            steps.append(PassStep("fork_sharded_random", fork_random,
                                  "after every sharding step: random ops on shards draw from the rank's own stream"))
    # cut after sharding, so stage costs are measured on the shards this rank runs
    if assign:  # (a block template assigns stages after repeating its blocks: lower_captured)
        steps.append(PassStep("assign_stages", stages, "cost-balanced stage cuts at block boundaries"))
    return tuple(steps)


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Virtual stages per pp rank: as requested, else the schedule family's (runtime/schedules/registry.py)."""
    return default_stages_per_rank(schedule, requested)


def _splits_backward(schedule: str) -> bool:
    return splits_backward(schedule)


def _slice_batch(tensors: tuple, size: int) -> tuple:
    return tuple(t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in tensors)


def _region_plan(region: TpRegion) -> TpRegionPlan:
    def paths(nodes):
        return tuple(user_name(get_meta(n, MODULE).path) for n in nodes)
    return TpRegionPlan(columns=paths(region.columns), rows=paths(region.rows))


def _select_vocab(gm: fx.GraphModule, *, mesh: MeshShape, options: CompileOptions, plan: Plan | None):
    if mesh.tp == 1 or not options.tensor_parallel or options.vocab_parallel is False:
        return VocabParallel()
    if plan is not None and not plan.vocab_parallel:
        return VocabParallel()
    return find_vocab_parallel(gm, tp_size=mesh.tp, strict=options.vocab_parallel is True)


def _select_regions(gm: fx.GraphModule, *, mesh: MeshShape, options: CompileOptions, plan: Plan | None,
                    skip=()):
    if mesh.tp == 1 or not options.tensor_parallel:
        return []
    regions = find_tp_regions(gm, skip=skip)
    if plan is None:
        return regions
    wanted = {r.columns for r in plan.tp_regions}
    return [r for r in regions if _region_plan(r).columns in wanted]


def _plan_starts(plan: Plan | None) -> list[str] | None:
    """The Plan's stage starts as graph unit names (None: let the partitioner choose)."""
    if plan is None or not plan.pipeline.stage_starts:
        return None
    return [MODEL_PREFIX + "." + s for s in plan.pipeline.stage_starts]


def _param_stages(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """{user name: stages reading it} of every parameter, read off the stage-assigned graph."""
    out = {}
    for node in gm.graph.nodes:
        info = get_meta(node, PARAM) if node.op == "get_attr" else None
        if info is None or not info.is_parameter:
            continue
        used = sorted({s.stage for u in node.users if (s := get_meta(u, STAGE)) is not None})
        out[user_name(node.target)] = tuple(used)
    return dict(sorted(out.items()))


LABELS = "labels"  # a dict batch carrying this key trains on the model's own loss when no loss_fn is given


def batch_inputs(example_inputs) -> tuple[tuple[str, ...] | None, tuple]:
    """(keyword names or None, the input tensors in order) of a tensor, a tuple of them or a dict batch."""
    if isinstance(example_inputs, Mapping):
        if not example_inputs:
            raise PlanError("example_inputs is an empty dict", where="example_inputs",
                            fix="pass the batch as the model takes it, e.g. {'input_ids': ..., 'attention_mask': ...}")
        for key, value in example_inputs.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise PlanError(f"example_inputs[{key!r}] is {type(value).__name__}: a dict batch maps names to tensors",
                                where=f"example_inputs[{key!r}]",
                                fix="pass only tensors with the batch on dim 0 (drop other entries)")
        return tuple(example_inputs), tuple(example_inputs.values())
    return None, tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


@dataclass
class Captured:
    """A model captured and analysed once, at microbatch shape; :func:`lower_captured` lowers it per tp rank."""

    model_name: str
    num_parameters: int
    mesh: MeshShape
    options: CompileOptions
    plan: Plan | None
    batch: int
    num_microbatches: int
    example_args: tuple  # the microbatch inputs (and target) the graph was captured with
    captured: CapturedGraph
    precision: str
    has_loss: bool
    template: BlockTemplate | None = None  # identical blocks: only the first few were captured


def lower(model: nn.Module, *, mesh: MeshShape, tp_rank: int, example_inputs: tuple,
          example_target=None, loss_fn=None, options: CompileOptions, plan: Plan | None = None,
          ep_rank: int = 0) -> Lowered:
    """Capture, analyse and transform ``model`` into the stage graphs of tensor-parallel rank ``tp_rank``
    (and expert-parallel rank ``ep_rank``)."""
    captured = capture_and_annotate(model, mesh=mesh, example_inputs=example_inputs, example_target=example_target,
                                    loss_fn=loss_fn, options=options, plan=plan)
    return lower_captured(captured, tp_rank=tp_rank, copy=False, ep_rank=ep_rank)


def capture_and_annotate(model: nn.Module, *, mesh: MeshShape, example_inputs: tuple, example_target=None,
                         loss_fn=None, options: CompileOptions, plan: Plan | None = None) -> Captured:
    """Capture and analyse ``model`` once, at the microbatch shape every rank runs."""
    if loss_fn is not None and example_target is None:
        raise PlanError("loss_fn given without example_target", where="compile/plan arguments",
                        fix="pass example_target= (one global batch of targets)")
    if plan is not None:
        plan = Plan.model_validate(plan.model_dump())  # a Plan edited with model_copy is checked here
        options = options.model_copy(update={"schedule": plan.pipeline.schedule,
                                             "num_microbatches": plan.pipeline.num_microbatches,
                                             "num_virtual": plan.pipeline.num_virtual,
                                             "zero_stage": plan.zero_stage, "capture": plan.capture,
                                             "data_parallel": plan.data_parallel, "bucket_mb": plan.bucket_mb,
                                             "sequence_parallel": plan.sequence_parallel,
                                             "expert_parallel": plan.expert_parallel,
                                             "moe_capacity_factor": plan.moe_capacity_factor})
    options = options.model_copy(update={"num_virtual": stages_per_rank(options.schedule, options.num_virtual)})
    keywords, example_inputs = batch_inputs(example_inputs)
    own_loss = loss_fn is None and keywords is not None and LABELS in keywords  # the model's own loss
    batch = example_inputs[0].shape[0]
    m = choose_microbatches(batch=batch, dp=mesh.dp, pp=mesh.pp, requested=options.num_microbatches)
    # a schedule that cannot run these sizes fails here, before the (slow) capture
    build_schedule(options.schedule, num_ranks=mesh.pp, num_microbatches=m, num_virtual=options.num_virtual)
    mb = batch // (mesh.dp * m)
    args = _slice_batch(example_inputs, mb)
    target = _slice_batch((example_target,), mb)[0] if example_target is not None else None
    if _is_meta(model):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        target = target.to("meta") if isinstance(target, torch.Tensor) else target
    precision = plan.precision if plan is not None else options.precision
    traced = low_precision_copy(model) if precision == "bf16" else model  # bf16: capture the model as bf16 code
    # identical blocks (an 80-layer list): capture a few, repeat the last one after sharding
    template = find_block_template(traced, mode=options.block_capture, plan=plan)
    captured, template = capture_blocks(template, lambda: capture(traced, args, loss_fn=loss_fn,
                                                                  example_target=target, mode=options.capture,
                                                                  keywords=keywords, own_loss=own_loss))
    # batch statistics (BatchNorm in training) are exact only when each forward sees the whole batch
    check_batch_statistics(captured.gm, dp=mesh.dp, num_microbatches=m)
    check_static_shapes(captured.gm)  # data-dependent output shapes (unique, nonzero, mask indexing)
    all_args = args + ((target,) if loss_fn is not None else ())
    annotate(captured.gm, example_inputs=all_args, model=traced)
    check_captured(captured, inputs=example_inputs + ((example_target,) if loss_fn is not None else ()))
    return Captured(model_name=type(model).__name__, num_parameters=sum(p.numel() for p in model.parameters()),
                    mesh=mesh, options=options, plan=plan, batch=batch, num_microbatches=m, example_args=all_args,
                    captured=captured, precision=precision, has_loss=captured.has_loss, template=template)


def shard_captured(cap: Captured, *, tp_rank: int, copy: bool = True, ep_rank: int = 0):
    """The transforms before the pipeline split (tensor, vocabulary and sequence parallelism).

    Returns (graph, what the passes found, the tp region plans, the vocabulary-parallel choice);
    stages are assigned too unless ``cap`` holds a block template (its blocks are repeated first).
    """
    mesh, options, plan = cap.mesh, cap.options, cap.plan
    gm = deepcopy(cap.captured.gm) if copy else cap.captured.gm
    vocab = _select_vocab(gm, mesh=mesh, options=options, plan=plan)
    regions = _select_regions(gm, mesh=mesh, options=options, plan=plan, skip=[vocab.head] if vocab.head else [])
    if mesh.tp > 1 and options.tensor_parallel:  # weight products no rule covers stay replicated: say so
        warn_unsharded_matmuls(gm)
    if options.expert_parallel > 1 and cap.template is not None:  # repeated blocks would not split their experts
        raise PlanError("expert_parallel does not combine with capturing identical blocks once yet",
                        where="block_capture (auto: a meta-built model with 8 or more identical blocks)",
                        fix="pass block_capture='every'")
    found: dict = {"specs": {}, "starts": [], "partial_grads": (), "experts": ()}
    steps = _pass_steps(mesh=mesh, tp_rank=tp_rank, options=options, regions=regions,
                        stage_starts=_plan_starts(plan), found=found, vocab=vocab, assign=cap.template is None,
                        random_ops=any(is_random(n) for n in gm.graph.nodes), ep_rank=ep_rank,
                        moe=mesh.dp > 1 and bool(find_moe_layers(gm).layers))
    gm = run_passes(gm, steps, example_inputs=cap.example_args)
    return gm, found, tuple(_region_plan(r) for r in regions), vocab


def lower_captured(cap: Captured, *, tp_rank: int, stages=None, copy: bool = True, ep_rank: int = 0) -> Lowered:
    """Transform a captured model into the stage graphs of tensor-parallel rank ``tp_rank``.

    ``copy``: transform a copy of the graph, so ``cap`` can be lowered again for another tp rank.
    ``stages``: build only these stage graphs (all when None); the Plan is the same either way.
    """
    mesh, options, plan, m = cap.mesh, cap.options, cap.plan, cap.num_microbatches
    gm, found, region_plans, vocab = shard_captured(cap, tp_rank=tp_rank, copy=copy, ep_rank=ep_rank)
    num_stages = mesh.pp * options.num_virtual
    if cap.template is not None:  # the last captured block stands for the rest: repeat it, then cut
        gm = cap.template.repeat(gm, tp_rank=tp_rank, tp_size=mesh.tp, specs=found["specs"])
        found["partial_grads"] = tuple(found["partial_grads"]) + tuple(
            cap.template.repeated_names(found["partial_grads"]))
        region_plans = cap.template.extend_regions(region_plans)
        gm, found["starts"] = assign_stages(gm, num_stages=num_stages, stage_starts=_plan_starts(plan))
    only = None if stages is None or options.schedule == "chimera" else sorted(set(stages))
    shared = _param_stages(gm) if only is not None else None  # from the graph: not every stage is built
    stages = split_pipeline(gm, num_stages=num_stages, only=only)
    if cap.has_loss and _splits_backward(options.schedule):
        # zero-bubble schedules run B and W apart: every weight use gets its own alias and output
        stages = [expose_weight_uses(s) for s in stages]
    if options.schedule == "chimera":
        # Chimera's second pipeline runs a second replica of every stage, in the other direction
        stages = replicate_stages(stages, num_replicas=2)
    modes = recompute_modes(plan.recompute if plan is not None else (), options.recompute,
                            len(stages) if only is None else num_stages)
    if cap.has_loss and _splits_backward(options.schedule):
        check_split_backward_recompute(modes, schedule=options.schedule)
    # after the split (send/recv stay outside every region), before ZeRO-3 gathers around whole regions
    stages = [recompute_stage(s, mode=modes[i if only is None else s.stage]) for i, s in enumerate(stages)]
    if options.zero_stage == 3 and options.data_parallel == "ddp":
        # last: shard every parameter over dp, gathered before use and freed after (ZeRO-3)
        check_zero3(options)
        stages = [shard_parameters_zero3(s, dp=mesh.dp) for s in stages]
    if shared is None:
        shared = {user_name(name): tuple(s.stage for s in stages if name in s.param_names)
                  for name in sorted({n for s in stages for n in s.param_names})}  # same order on every rank
    new_plan = Plan(
        model_name=cap.model_name, mesh=mesh, global_batch_size=cap.batch,
        pipeline=PipelinePlan(schedule=options.schedule, num_microbatches=m, num_virtual=options.num_virtual,
                              stage_starts=tuple(user_name(s) for s in found["starts"])),
        tp_regions=region_plans,
        param_shards={user_name(k): ParamShard(dim=v.dim, chunks=v.chunks) for k, v in found["specs"].items()},
        vocab_parallel=tuple(user_name(p) for p in vocab.paths()),
        sequence_parallel=options.sequence_parallel and mesh.tp > 1 and options.tensor_parallel,
        shared_params={k: v for k, v in shared.items() if len(v) > 1},
        zero_stage=options.zero_stage, capture=options.capture, data_parallel=options.data_parallel,
        bucket_mb=options.bucket_mb,
        num_parameters=cap.num_parameters,
        recompute=modes if any(mode != "none" for mode in modes) else (), precision=cap.precision,
        expert_parallel=options.expert_parallel, expert_params=tuple(user_name(t) for t in found["experts"]),
        moe_capacity_factor=options.moe_capacity_factor,
    )
    return Lowered(plan=new_plan, captured=cap.captured, stages=stages, param_shards=found["specs"],
                   tp_partial_grads=tuple(found["partial_grads"]))
