"""From a model and a mesh to one rank's stage graphs: the compiler's passes, in order.

Both entry points share this: :func:`autopar.compile` lowers for its own rank inside torchrun,
:func:`autopar.plan` lowers every (tp rank) in a plain process. The pipeline of passes is written
out once, in :func:`_pass_steps`, one line per pass with the reason it runs there.
"""
from __future__ import annotations

import logging
from copy import deepcopy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError
from autopar.options import CompileOptions, resolve_plan
from autopar.passes.annotate import annotate
from autopar.passes.batch_stats import check_batch_statistics
from autopar.passes.block_template import BlockTemplate, capture_blocks, find_block_template
from autopar.passes.capture import MODEL_PREFIX, CapturedGraph, capture
from autopar.passes.graph_names import user_name
from autopar.passes.mean_loss import find_token_mean_loss
from autopar.passes.meta_keys import MODULE, PARAM, STAGE, get_meta
from autopar.passes.moe_aux import sync_router_statistics
from autopar.passes.moe_detect import find_moe_layers
from autopar.passes.moe_expert_parallel import shard_experts
from autopar.passes.partition import assign_stages
from autopar.passes.pass_manager import PassStep, run_passes
from autopar.passes.pipeline_split import StageGraph, split_pipeline
from autopar.passes.recompute import recompute_stage
from autopar.passes.sequence_parallel import shard_sequence_parallel
from autopar.passes.shard_layout import ShardLayout
from autopar.passes.tensor_parallel import shard_tensor_parallel
from autopar.passes.tp_random import fork_sharded_random, is_random
from autopar.passes.static_shapes import check_static_shapes
from autopar.passes.tp_coverage import warn_unsharded_matmuls
from autopar.passes.tp_expert import find_expert_regions, shard_expert_parallel
from autopar.passes.tp_regions import TpRegion, find_tp_regions
from autopar.passes.vocab_parallel import VocabParallel, find_vocab_parallel, shard_vocab_parallel
from autopar.passes.weight_grad_split import check_split_backward_recompute, expose_weight_uses
from autopar.passes.zero3 import check_zero3, shard_parameters_zero3
from autopar.passes.low_precision import low_precision_copy
from autopar.plan_model import MeshShape, Plan, TpRegionPlan
from autopar.passes.chimera_replicate import replicate_stages
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.registry import build_schedule, family, splits_backward
from autopar.runtime.schedules.validator import validate
from autopar.validation import check_captured

__all__ = ["Lowered", "Captured", "LoweringState", "lower", "capture_and_annotate", "shard_captured", "lower_captured",
           "user_name", "batch_inputs", "LABELS"]

log = logging.getLogger(__name__)


@dataclass
class Lowered:
    """The result of lowering for one tp rank: the Plan, the captured graph and every stage graph."""

    plan: Plan
    captured: CapturedGraph
    stages: list[StageGraph]
    param_shards: dict[str, ShardLayout]
    schedule: Schedule  # the Plan's schedule, validated (built once, in capture_and_annotate)
    tp_partial_grads: tuple[str, ...] = ()  # replicated params read on sequence shards: grads summed over tp


@dataclass(frozen=True)
class LoweringState:
    """What the passes hand each other: the graph, from the split on its stage graphs, and what they found.

    Every pass of :func:`_pass_steps` maps one LoweringState to the next (``dataclasses.replace``);
    the pass manager checks :meth:`graphs` after each.
    """

    gm: fx.GraphModule
    example_inputs: tuple
    stages: tuple[StageGraph, ...] | None = None  # None before the pipeline split
    specs: Mapping[str, ShardLayout] = field(default_factory=dict)  # tp-sharded parameters (graph names)
    partial_grads: tuple[str, ...] = ()  # replicated params read on sequence shards: grads summed over tp
    region_plans: tuple[TpRegionPlan, ...] = ()
    starts: tuple[str, ...] = ()  # the unit each stage after the first begins at (graph names)
    shared: Mapping[str, tuple[int, ...]] | None = None  # {user name: stages reading it}, read before the split
    experts: tuple[str, ...] = ()  # the expert tensors split over ep (graph names; passes/moe_expert_parallel.py)

    def graphs(self):
        if self.stages is None:
            return (("graph", self.gm, self.example_inputs),)
        return tuple((f"stage {s.stage}", s.gm, None) for s in self.stages)


@dataclass(frozen=True)
class _Setting:
    """What the passes of one lowering read: the Plan and what the analyses chose for this tp rank."""

    plan: Plan
    tp_rank: int
    regions: tuple[TpRegion, ...]
    vocab: VocabParallel
    template: BlockTemplate | None
    has_loss: bool
    only: list[int] | None  # build only these stage graphs (None: all)
    random_ops: bool
    experts: tuple = ()  # expert MLPs sharded over tp (passes/tp_expert.py)
    ep_rank: int = 0  # this rank's place among the ep ranks that split the MoE experts
    moe: bool = False  # the graph has MoE layers the dp ranks must see as one batch (their aux loss)


def _shard(st: LoweringState, *, s: _Setting) -> LoweringState:
    gm, specs = shard_tensor_parallel(st.gm, tp_size=s.plan.mesh.tp, tp_rank=s.tp_rank, regions=list(s.regions))
    return replace(st, gm=gm, specs={**st.specs, **specs})


def _shard_vocab(st: LoweringState, *, s: _Setting) -> LoweringState:
    gm, specs = shard_vocab_parallel(st.gm, s.vocab, tp_size=s.plan.mesh.tp, tp_rank=s.tp_rank)
    return replace(st, gm=gm, specs={**st.specs, **specs})


def _router_statistics(st: LoweringState, *, s: _Setting) -> LoweringState:
    return replace(st, gm=sync_router_statistics(st.gm, dp=s.plan.mesh.dp)[0])


def _split_experts(st: LoweringState, *, s: _Setting) -> LoweringState:
    gm, experts = shard_experts(st.gm, ep=s.plan.expert_parallel, ep_rank=s.ep_rank,
                                capacity_factor=s.plan.moe_capacity_factor)
    return replace(st, gm=gm, experts=tuple(experts))


def _shard_experts(st: LoweringState, *, s: _Setting) -> LoweringState:
    gm, specs = shard_expert_parallel(st.gm, list(s.experts), tp_size=s.plan.mesh.tp, tp_rank=s.tp_rank)
    return replace(st, gm=gm, specs={**st.specs, **specs})


def _shard_sequence(st: LoweringState, *, s: _Setting) -> LoweringState:
    gm, partial = shard_sequence_parallel(st.gm, tp_size=s.plan.mesh.tp,
                                          regather=not splits_backward(s.plan.pipeline.schedule))
    return replace(st, gm=gm, partial_grads=tuple(partial))


def _fork_random(st: LoweringState, *, s: _Setting) -> LoweringState:
    return replace(st, gm=fork_sharded_random(st.gm, seed=torch.initial_seed(), tp_rank=s.tp_rank))


def _repeat_blocks(st: LoweringState, *, s: _Setting) -> LoweringState:
    specs = dict(st.specs)  # (repeat adds the later blocks' shards)
    gm = s.template.repeat(st.gm, tp_rank=s.tp_rank, tp_size=s.plan.mesh.tp, specs=specs,
                           experts=(s.plan.expert_parallel, s.ep_rank, frozenset(st.experts)))
    return replace(st, gm=gm, specs=specs, experts=st.experts + tuple(s.template.repeated_names(st.experts)),
                   partial_grads=st.partial_grads + tuple(s.template.repeated_names(st.partial_grads)),
                   region_plans=s.template.extend_regions(st.region_plans))


def _assign(st: LoweringState, *, s: _Setting) -> LoweringState:
    p = s.plan
    gm, starts = assign_stages(st.gm, num_stages=p.mesh.pp * p.pipeline.num_virtual, stage_starts=_plan_starts(p))
    return replace(st, gm=gm, starts=tuple(starts))


def _split(st: LoweringState, *, s: _Setting) -> LoweringState:
    shared = _param_stages(st.gm) if s.only is not None else None  # from the graph: not every stage is built
    stages = split_pipeline(st.gm, num_stages=s.plan.mesh.pp * s.plan.pipeline.num_virtual, only=s.only)
    return replace(st, stages=tuple(stages), shared=shared)


def _shared_params(st: LoweringState) -> dict[str, tuple[int, ...]]:
    """{user name: stages holding it} of the weights more than one stage holds (replicas included)."""
    shared = st.shared
    if shared is None:  # every stage graph was built: read them
        shared = {user_name(name): tuple(g.stage for g in st.stages if name in g.param_names)
                  for name in sorted({n for g in st.stages for n in g.param_names})}  # same order on every rank
    return {k: v for k, v in shared.items() if len(v) > 1}


def _expose_weights(st: LoweringState, *, s: _Setting) -> LoweringState:
    return replace(st, stages=tuple(expose_weight_uses(g) for g in st.stages))


def _replicate(st: LoweringState, *, s: _Setting) -> LoweringState:
    stages = replicate_stages(list(st.stages), num_replicas=family(s.plan.pipeline.schedule).replicas)
    return replace(st, stages=tuple(stages))


def _recompute(st: LoweringState, *, s: _Setting) -> LoweringState:
    modes, n = s.plan.recompute, s.plan.mesh.pp * s.plan.pipeline.num_virtual
    return replace(st, stages=tuple(recompute_stage(g, mode=modes[g.stage % n]) for g in st.stages))


def _zero3(st: LoweringState, *, s: _Setting) -> LoweringState:
    experts = frozenset(user_name(t) for t in st.experts)  # MoE experts split over ep: sharded over edp = dp / ep
    return replace(st, stages=tuple(shard_parameters_zero3(g, dp=s.plan.mesh.dp, experts=experts,
                                                           ep=s.plan.expert_parallel) for g in st.stages))


def _sharding_steps(s: _Setting) -> list[PassStep]:
    """The transforms before the stage cuts, in order (what :func:`shard_captured` runs)."""
    p, tp = s.plan, s.plan.mesh.tp > 1
    steps = [  # (runs?, the pass, why it runs there)
        (p.mesh.dp > 1 and s.moe, "sync_router_statistics", _router_statistics,
         "MoE routers' load-balancing statistics over the global batch: the aux loss as one device computes it"),
        (p.expert_parallel > 1, "shard_experts", _split_experts,
         "MoE experts over ep ranks with all-to-all dispatch/combine; first, so tp and pp see those nodes"),
        (tp, "shard_tensor_parallel", _shard, "Megatron f/g around each region; before the split, so a "
                                              "region's column and row linears always share a stage"),
        (tp and bool(s.vocab), "shard_vocab_parallel", _shard_vocab,
         "embedding, LM head and loss on vocabulary shards; the head's f joins the others"),
        (tp and bool(s.experts), "shard_expert_parallel", _shard_experts, "each expert's MLP column/row over tp"),
        (tp and p.sequence_parallel, "shard_sequence_parallel", _shard_sequence,
         "needs every f and g in place: they become all-gathers and reduce-scatters"),
        (tp and s.random_ops, "fork_sharded_random", _fork_random,
         "after every sharding step: random ops on shards draw from the rank's own stream"),
    ]
    return [PassStep(name, partial(fn, s=s), why) for on, name, fn, why in steps if on]


def _pipeline_steps(s: _Setting) -> list[PassStep]:
    """The transforms from the stage cuts on, in order: stage assignment, the split, then per stage graph."""
    p, schedule = s.plan, family(s.plan.pipeline.schedule)
    split_backward = s.has_loss and schedule.split_backward
    steps = [  # (runs?, the pass, why it runs there)
        (s.template is not None, "repeat_blocks", _repeat_blocks,
         "the last captured block stands for the rest: stamped out after sharding, before the cuts"),
        (True, "assign_stages", _assign, "cost-balanced cuts at block boundaries, measured on this rank's shards"),
        (True, "split_pipeline", _split, "one graph per stage, with send/recv between them"),
        (split_backward, "expose_weight_uses", _expose_weights,
         "zero-bubble schedules run B and W apart: every weight use gets its own alias and output"),
        (schedule.replicas > 1, "replicate_stages", _replicate,
         "Chimera's second pipeline runs a second replica of every stage, in the other direction"),
        (any(m != "none" for m in p.recompute), "recompute", _recompute,
         "after the split (send/recv stay outside every region), before ZeRO-3 gathers around whole regions"),
        (p.zero_stage == 3 and p.data_parallel == "ddp", "shard_parameters_zero3", _zero3,
         "last: every parameter sharded over dp, gathered before use and freed after"),
    ]
    return [PassStep(name, partial(fn, s=s), why, rewrites=name not in _ANALYSES)
            for on, name, fn, why in steps if on]


_ANALYSES = frozenset({"assign_stages"})  # steps that only write node meta: not re-propagated after


def _pass_steps(s: _Setting) -> tuple[PassStep, ...]:
    """The pipeline of transforms after capture and analysis, in order: the pass manager runs it."""
    return tuple(_sharding_steps(s) + _pipeline_steps(s))


def _slice_batch(tensors: tuple, size: int) -> tuple:
    return tuple(t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in tensors)


def _region_plan(region: TpRegion) -> TpRegionPlan:
    def paths(nodes):
        return tuple(user_name(get_meta(n, MODULE).path) for n in nodes)
    return TpRegionPlan(columns=paths(region.columns), rows=paths(region.rows), gathered=paths(region.gathers))


def _select_vocab(gm: fx.GraphModule, cap: "Captured") -> VocabParallel:
    """The embedding, head and loss to shard on the vocabulary: as the given Plan says, else where they divide."""
    options, plan = cap.options, cap.plan
    if plan.mesh.tp == 1 or not options.tensor_parallel or options.vocab_parallel is False:
        return VocabParallel()
    if cap.pinned and not plan.vocab_parallel:
        return VocabParallel()
    return find_vocab_parallel(gm, tp_size=plan.mesh.tp, strict=options.vocab_parallel is True)


def _select_regions(gm: fx.GraphModule, cap: "Captured", *, skip=()) -> list[TpRegion]:
    """The tensor-parallel regions: those the given Plan names, else every one found."""
    if cap.plan.mesh.tp == 1 or not cap.options.tensor_parallel:
        return []
    regions = find_tp_regions(gm, skip=skip, tp_size=cap.plan.mesh.tp)
    if not cap.pinned:
        return regions
    wanted = {r.columns for r in cap.plan.tp_regions}
    return [r for r in regions if _region_plan(r).columns in wanted]


def _select_experts(gm: fx.GraphModule, cap: "Captured") -> tuple:
    """Expert MLPs sharded over tp (passes/tp_expert.py); with a given Plan, those whose weights it shards."""
    if cap.plan.mesh.tp == 1 or not cap.options.tensor_parallel:
        return ()
    regions = find_expert_regions(gm)
    if not cap.pinned:
        return tuple(regions)
    return tuple(r for r in regions if all(user_name(t) in cap.plan.param_shards for t in r.specs))


def _plan_starts(plan: Plan) -> list[str] | None:
    """The Plan's stage starts as graph unit names (None: let the partitioner choose)."""
    if not plan.pipeline.stage_starts:
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
    """A model captured and analysed once, at microbatch shape; :func:`lower_captured` lowers it per tp rank.

    ``plan`` holds every decision (:func:`autopar.options.resolve_plan`); the lowering reads it and,
    of the options, only what steers the analyses (``tensor_parallel``, ``vocab_parallel``).
    """

    plan: Plan
    pinned: bool  # the Plan was given: its stage starts, regions and vocabulary choice are taken as written
    options: CompileOptions
    example_args: tuple  # the microbatch inputs (and target) the graph was captured with
    captured: CapturedGraph
    has_loss: bool
    schedule: Schedule  # built and validated once, for every rank
    template: BlockTemplate | None = None  # identical blocks: only the first few were captured

    @property
    def mesh(self) -> MeshShape:
        return self.plan.mesh

    @property
    def num_microbatches(self) -> int:
        return self.plan.pipeline.num_microbatches


def lower(model: nn.Module, *, mesh: MeshShape, tp_rank: int, example_inputs: tuple,
          example_target=None, loss_fn=None, options: CompileOptions, plan: Plan | None = None,
          dp_rank: int = 0) -> Lowered:
    """Capture, analyse and transform ``model`` into the stage graphs of tensor-parallel rank ``tp_rank``
    (and of dp rank ``dp_rank``'s experts when the Plan splits them over ep)."""
    captured = capture_and_annotate(model, mesh=mesh, example_inputs=example_inputs, example_target=example_target,
                                    loss_fn=loss_fn, options=options, plan=plan)
    return lower_captured(captured, tp_rank=tp_rank, copy=False, dp_rank=dp_rank)


def _check_plan(plan: Plan, *, has_loss: bool) -> Schedule:
    """What the Plan alone decides: its schedule (built and validated once) and the combinations it refuses."""
    p = plan.pipeline
    schedule = build_schedule(p.schedule, num_ranks=plan.mesh.pp, num_microbatches=p.num_microbatches,
                              num_virtual=p.num_virtual)
    validate(schedule)
    if has_loss and schedule.split_backward:
        check_split_backward_recompute(plan.recompute or ("none",), schedule=p.schedule)
    if plan.zero_stage == 3 and plan.data_parallel == "ddp":
        check_zero3(p)
    return schedule


def capture_and_annotate(model: nn.Module, *, mesh: MeshShape, example_inputs: tuple, example_target=None,
                         loss_fn=None, options: CompileOptions, plan: Plan | None = None) -> Captured:
    """Resolve the Plan, then capture and analyse ``model`` once, at the microbatch shape every rank runs."""
    if loss_fn is not None and example_target is None:
        raise PlanError("loss_fn given without example_target", where="compile/plan arguments",
                        fix="pass example_target= (one global batch of targets)")
    given = Plan.model_validate(plan.model_dump()) if plan is not None else None  # (an edited Plan is checked)
    keywords, example_inputs = batch_inputs(example_inputs)
    own_loss = loss_fn is None and keywords is not None and LABELS in keywords  # the model's own loss
    batch = example_inputs[0].shape[0]
    plan = resolve_plan(options, given=given, mesh=mesh, batch=batch, model_name=type(model).__name__,
                        num_parameters=sum(p.numel() for p in model.parameters()))
    # a schedule that cannot run these sizes fails here, before the (slow) capture
    schedule = _check_plan(plan, has_loss=loss_fn is not None or own_loss)
    mb = plan.microbatch_size
    args = _slice_batch(example_inputs, mb)
    target = _slice_batch((example_target,), mb)[0] if example_target is not None else None
    if _is_meta(model):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        target = target.to("meta") if isinstance(target, torch.Tensor) else target
    traced = low_precision_copy(model) if plan.precision == "bf16" else model  # bf16: capture the model as bf16 code
    # identical blocks (an 80-layer list): capture a few, repeat the last one after sharding
    template = find_block_template(traced, mode=options.block_capture, plan=given)
    captured, template = capture_blocks(template, lambda: capture(traced, args, loss_fn=loss_fn,
                                                                  example_target=target, mode=plan.capture,
                                                                  keywords=keywords, own_loss=own_loss))
    # batch statistics (BatchNorm in training) are exact only when each forward sees the whole batch
    check_batch_statistics(captured.gm, dp=mesh.dp, num_microbatches=plan.pipeline.num_microbatches)
    check_static_shapes(captured.gm)  # data-dependent output shapes (unique, nonzero, mask indexing)
    if captured.has_target:  # a token-mean loss_fn: weighted by each microbatch's tokens (passes/mean_loss.py)
        captured.loss_weight = find_token_mean_loss(captured.gm)
    extra = captured.extra_args  # inputs capture added (the model's own loss: its label-token count)
    all_args = args + extra + ((target,) if loss_fn is not None else ())
    annotate(captured.gm, example_inputs=all_args, model=traced)
    check_captured(captured, inputs=example_inputs + extra + ((example_target,) if loss_fn is not None else ()))
    return Captured(plan=plan, pinned=given is not None, options=options, example_args=all_args, captured=captured,
                    has_loss=captured.has_loss, schedule=schedule, template=template)


def _setting(cap: Captured, gm: fx.GraphModule, *, tp_rank: int, only=None, dp_rank: int = 0) -> _Setting:
    vocab = _select_vocab(gm, cap)
    regions = _select_regions(gm, cap, skip=[vocab.head] if vocab.head else [])
    if cap.plan.mesh.tp > 1 and cap.options.tensor_parallel:  # weight products no rule covers stay replicated: say so
        warn_unsharded_matmuls(gm)
    return _Setting(plan=cap.plan, tp_rank=tp_rank, regions=tuple(regions), vocab=vocab, template=cap.template,
                    has_loss=cap.has_loss, only=only, random_ops=any(is_random(n) for n in gm.graph.nodes),
                    experts=_select_experts(gm, cap), ep_rank=dp_rank % cap.plan.expert_parallel,
                    moe=cap.plan.mesh.dp > 1 and bool(find_moe_layers(gm).layers))


def _start(cap: Captured, s: _Setting, gm: fx.GraphModule) -> LoweringState:
    return LoweringState(gm=gm, example_inputs=cap.example_args, region_plans=tuple(_region_plan(r) for r in s.regions))


def shard_captured(cap: Captured, *, tp_rank: int, copy: bool = True,
                   dp_rank: int = 0) -> tuple[LoweringState, VocabParallel]:
    """The transforms before the stage cuts (tensor, vocabulary and sequence parallelism), on a copy.

    Returns the state after them (its graph and what the passes found) and the vocabulary-parallel choice.
    """
    gm = deepcopy(cap.captured.gm) if copy else cap.captured.gm
    s = _setting(cap, gm, tp_rank=tp_rank, dp_rank=dp_rank)
    return run_passes(_start(cap, s, gm), _sharding_steps(s), example_inputs=cap.example_args), s.vocab


def lower_captured(cap: Captured, *, tp_rank: int, stages=None, copy: bool = True, dp_rank: int = 0) -> Lowered:
    """Transform a captured model into the stage graphs of tensor-parallel rank ``tp_rank``.

    ``copy``: transform a copy of the graph, so ``cap`` can be lowered again for another tp rank.
    ``stages``: build only these stage graphs (all when None); the Plan is the same either way.
    """
    plan = cap.plan
    gm = deepcopy(cap.captured.gm) if copy else cap.captured.gm
    only = None if stages is None or family(plan.pipeline.schedule).replicas > 1 else sorted(set(stages))
    s = _setting(cap, gm, tp_rank=tp_rank, only=only, dp_rank=dp_rank)
    st = run_passes(_start(cap, s, gm), _pass_steps(s), example_inputs=cap.example_args)
    lowered_plan = Plan(**{
        **dict(plan),
        "pipeline": plan.pipeline.model_copy(update={"stage_starts": tuple(user_name(u) for u in st.starts)}),
        "tp_regions": st.region_plans,
        "param_shards": {user_name(k): v for k, v in st.specs.items()},
        "vocab_parallel": tuple(user_name(p) for p in s.vocab.paths()),
        "shared_params": _shared_params(st),
        "recompute": plan.recompute if any(m != "none" for m in plan.recompute) else (),
        "expert_params": tuple(user_name(t) for t in st.experts),
    })
    return Lowered(plan=lowered_plan, captured=cap.captured, stages=list(st.stages), param_shards=dict(st.specs),
                   schedule=cap.schedule, tp_partial_grads=st.partial_grads)
