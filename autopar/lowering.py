"""From a model and a mesh to one rank's stage graphs: the compiler's passes, in order.

Both entry points share this: :func:`autopar.compile` lowers for its own rank inside torchrun,
:func:`autopar.plan` lowers every (tp rank) in a plain process. Every step from the Plan's checks to
ZeRO-3 is a pass of one signature, ``LoweringState -> LoweringState``
(:class:`~autopar.passes.lowering_state.LoweringState`), listed once, in order, in :func:`passes`, each
line saying why it runs there; the pass manager (:func:`~autopar.passes.pass_manager.run_passes`) checks
every step, analyses included. docs/architecture.md prints the list (tests/api/test_pass_list.py holds
the page to it).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from autopar.errors import PlanError
from autopar.ir.captured_graph import CapturedGraph
from autopar.ir.graph_names import user_name
from autopar.ir.shard_layout import ShardLayout
from autopar.ir.stage_graph import StageGraph
from autopar.options import CompileOptions, resolve_plan
from autopar.passes.frontend.annotate import annotate_graph
from autopar.passes.frontend.batch_stats import check_batch_statistics
from autopar.passes.frontend.block_template import repeat_blocks
from autopar.passes.frontend.capture_model import capture_model, is_meta
from autopar.passes.pipeline.chimera_replicate import replicate_stages
from autopar.passes.lowering_state import LoweringState, ModelSource
from autopar.passes.frontend.mean_loss import find_token_mean_loss
from autopar.passes.moe.moe_aux import sync_router_statistics
from autopar.passes.moe.moe_expert_parallel import shard_experts
from autopar.passes.pipeline.partition import assign_stages
from autopar.passes.pass_manager import PassStep, run_passes
from autopar.passes.pipeline.pipeline_split import split_pipeline
from autopar.passes.pipeline.recompute import recompute
from autopar.passes.frontend.seq_bounds import bound_dynamic_dims
from autopar.passes.context_parallel.cp_shard import shard_context_parallel
from autopar.passes.tp.sequence_parallel import shard_sequence_parallel
from autopar.passes.frontend.static_shapes import check_static_shapes
from autopar.passes.tp.tensor_parallel import shard_tensor_parallel
from autopar.passes.moe.tp_expert import shard_expert_parallel
from autopar.passes.tp.tp_random import fork_sharded_random
from autopar.passes.tp.tp_select import select_expert_regions, select_tp_regions, select_vocab_parallel
from autopar.passes.tp.vocab_parallel import VocabParallel, shard_vocab_parallel
from autopar.passes.pipeline.weight_grad_split import expose_weight_uses
from autopar.passes.data_parallel.zero3 import shard_parameters_zero3
from autopar.plan_model import Plan
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.registry import family
from autopar.validation import check_captured, check_plan

__all__ = ["Lowered", "Captured", "LoweringState", "passes", "PHASES", "resolve", "lower", "capture_and_annotate",
           "capture_planned", "capture_source", "shard_captured", "lower_captured", "user_name", "batch_inputs",
           "LABELS"]

log = logging.getLogger(__name__)

#: the lowering's phases: once per model; per rank before the stage cuts; per rank from them on
PHASES = ("model", "shard", "pipeline")
Captured = LoweringState  # the state after the model phase: what every rank's lowering starts from


# when a pass runs, read off the Plan (its docstring is what docs/architecture.md prints)
def _dp(st: LoweringState) -> bool:
    """dp > 1"""
    return st.plan.mesh.dp > 1


def _cp(st: LoweringState) -> bool:
    """cp > 1"""
    return st.plan.mesh.cp > 1


def _ep(st: LoweringState) -> bool:
    """expert_parallel > 1"""
    return st.plan.expert_parallel > 1


def _tp(st: LoweringState) -> bool:
    """tp > 1"""
    return st.plan.mesh.tp > 1


def _sp(st: LoweringState) -> bool:
    """tp > 1 and sequence_parallel"""
    return _tp(st) and st.plan.sequence_parallel


def _template(st: LoweringState) -> bool:
    """identical blocks were captured once"""
    return st.template is not None


def _split_backward(st: LoweringState) -> bool:
    """a loss, and a schedule that splits backward (zero-bubble)"""
    return st.has_loss and family(st.plan.pipeline.schedule).split_backward


def _replicas(st: LoweringState) -> bool:
    """the schedule family runs model replicas (Chimera)"""
    return family(st.plan.pipeline.schedule).replicas > 1


def _recompute(st: LoweringState) -> bool:
    """some stage's recompute mode is not none"""
    return any(m != "none" for m in st.plan.recompute)


def _zero3(st: LoweringState) -> bool:
    """zero_stage=3 with DDP"""
    return st.plan.zero_stage == 3 and st.plan.data_parallel == "ddp"


def passes() -> tuple[PassStep, ...]:
    """Every pass from the model to one rank's stage graphs, in order: (phase, pass, kind, runs when (None:
    always), why it runs there). Analyses sit right before the pass that first reads what they find; a pass
    with nothing to do for this graph (no MoE layer, no random op) hands its state back unchanged."""
    steps = [
        ("model", "check_plan", "check", None,
         "what the Plan alone decides, before the slow capture: its schedule built and validated once for every "
         "rank, and the recompute modes and ZeRO-3 pipelines it refuses"),
        ("model", "capture_model", "capture", None,
         "one graph of the whole model at microbatch shape (bf16 code under bf16; identical blocks captured once; "
         "the sequence dim symbolic under dynamic_shapes=seq)"),
        ("model", "check_batch_statistics", "check", None,
         "batch statistics (BatchNorm in training) are exact only when each forward sees the whole batch"),
        ("model", "check_static_shapes", "check", None,
         "data-dependent output shapes (unique, nonzero, mask indexing), refused before shapes are propagated"),
        ("model", "find_token_mean_loss", "analysis", None,
         "a token-mean loss_fn: each microbatch's loss is weighted by its tokens at run time"),
        ("model", "annotate_graph", "analysis", None,
         "shapes, dtypes, FLOPs, bytes, module paths and parameter ownership: what every later pass reads"),
        ("model", "check_captured", "check", None,
         "what only the annotated graph shows: a scalar loss, example indices inside the tables they index"),
        ("model", "bound_dynamic_dims", "analysis", None,
         "the longest sequence a batch may hold (max_seq_len, export's range, the position tables the annotated "
         "graph indexes, the config) and the symbolic dims, into the Plan every rank's runtime checks batches by"),
        ("shard", "shard_context_parallel", "transform", _cp,
         "the sequence cut over cp (attention by ring or all-to-all, global positions); first, on the captured "
         "graph the attention and sequence analyses read, so tp and pp shard the rank's shard"),
        ("shard", "sync_router_statistics", "transform", _dp,
         "MoE routers' load-balancing statistics over the global batch: the aux loss as one device computes it"),
        ("shard", "shard_experts", "transform", _ep,
         "MoE experts over ep ranks with all-to-all dispatch/combine; first, so tp and pp see those nodes"),
        ("shard", "select_vocab_parallel", "analysis", _tp,
         "the embedding, head and loss on vocabulary shards; before the regions, which leave the head to it"),
        ("shard", "select_tp_regions", "analysis", _tp,
         "the Megatron regions, found on the graph the next pass rewrites (after the experts' rewrite)"),
        ("shard", "shard_tensor_parallel", "transform", _tp,
         "Megatron f/g around each region; before the split, so a region's column and row linears share a stage"),
        ("shard", "shard_vocab_parallel", "transform", _tp,
         "embedding, LM head and loss on vocabulary shards; the head's f joins the others"),
        ("shard", "select_expert_regions", "analysis", _tp,
         "the expert MLPs to shard over tp, found right before their rewrite"),
        ("shard", "shard_expert_parallel", "transform", _tp, "each expert's MLP column/row over tp"),
        ("shard", "shard_sequence_parallel", "transform", _sp,
         "needs every f and g in place: they become all-gathers and reduce-scatters"),
        ("shard", "fork_sharded_random", "transform", _tp,
         "after every sharding step: random ops on shards draw from the rank's own stream"),
        ("pipeline", "repeat_blocks", "transform", _template,
         "the last captured block stands for the rest: stamped out after sharding, before the cuts"),
        ("pipeline", "assign_stages", "analysis", None,
         "cost-balanced cuts at block boundaries, measured on this rank's shards"),
        ("pipeline", "split_pipeline", "transform", None,
         "one graph per stage, with send/recv between them (edge shapes in the symbolic dims when the graph keeps "
         "any: docs/batches.md)"),
        ("pipeline", "expose_weight_uses", "transform", _split_backward,
         "zero-bubble schedules run B and W apart: every weight use gets its own alias and output"),
        ("pipeline", "replicate_stages", "transform", _replicas,
         "Chimera's second pipeline runs a second replica of every stage, in the other direction"),
        ("pipeline", "recompute", "transform", _recompute,
         "after the split (send/recv stay outside every region), before ZeRO-3 gathers around whole regions"),
        ("pipeline", "shard_parameters_zero3", "transform", _zero3,
         "last: every parameter sharded over dp, gathered before use and freed after"),
    ]
    here = globals()  # each pass by its name in this module (its import above)
    return tuple(PassStep(name, here[name], why, kind=kind, runs=runs, phase=phase)
                 for phase, name, kind, runs, why in steps)


def _phase(*names: str) -> list[PassStep]:
    return [s for s in passes() if s.phase in names]


@dataclass
class Lowered:
    """The result of lowering for one tp rank: the Plan, the captured graph and every stage graph."""

    plan: Plan
    captured: CapturedGraph
    stages: list[StageGraph]
    param_shards: dict[str, ShardLayout]
    schedule: Schedule  # the Plan's schedule, validated (built once, by check_plan)
    tp_partial_grads: tuple[str, ...] = ()  # replicated params read on sequence shards: grads summed over tp
    example_shapes: dict = field(default_factory=dict)  # {graph input: the microbatch shape it was lowered at}


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


_is_meta = is_meta  # (autopar.compile asks it of the user's model)


def resolve(model: nn.Module, *, mesh, example_inputs, options: CompileOptions, plan: Plan | None = None) -> Plan:
    """The Plan of ``model`` on ``mesh``: :func:`autopar.options.resolve_plan` (the one place options become
    decisions) of a given ``plan`` (checked again: it may have been edited) or of the options alone.
    Each way into the lowering calls it once; the planner's Plan comes resolved."""
    given = Plan.model_validate(plan.model_dump()) if plan is not None else None
    inputs = batch_inputs(example_inputs)[1]
    return resolve_plan(options, given=given, mesh=mesh, batch=inputs[0].shape[0], model_name=type(model).__name__,
                        num_parameters=sum(p.numel() for p in model.parameters()))


def lower(model: nn.Module, *, plan: Plan, pinned: bool, tp_rank: int, example_inputs, example_target=None,
          loss_fn=None, options: CompileOptions, dp_rank: int = 0) -> Lowered:
    """Capture, analyse and transform ``model`` under the resolved ``plan`` into the stage graphs of
    tensor-parallel rank ``tp_rank`` (and of dp rank ``dp_rank``'s experts when the Plan splits them over ep)."""
    captured = capture_planned(model, plan=plan, pinned=pinned, example_inputs=example_inputs,
                               example_target=example_target, loss_fn=loss_fn, options=options)
    return lower_captured(captured, tp_rank=tp_rank, copy=False, dp_rank=dp_rank)


def capture_and_annotate(model: nn.Module, *, mesh, example_inputs, example_target=None, loss_fn=None,
                         options: CompileOptions, plan: Plan | None = None, dynamic=None) -> LoweringState:
    """:func:`resolve` the Plan (a given ``plan`` is pinned: taken as written), then :func:`capture_planned`."""
    resolved = resolve(model, mesh=mesh, example_inputs=example_inputs, options=options, plan=plan)
    return capture_planned(model, plan=resolved, pinned=plan is not None, example_inputs=example_inputs,
                           example_target=example_target, loss_fn=loss_fn, options=options, dynamic=dynamic)


def capture_planned(model: nn.Module, *, plan: Plan, pinned: bool, example_inputs, example_target=None,
                    loss_fn=None, options: CompileOptions, dynamic=None) -> LoweringState:
    """Run the model phase of :func:`passes` once under the resolved ``plan``: the state every rank lowers from.

    ``pinned``: the Plan was given (by the user or the planner): its stage starts, regions, vocabulary and
    expert shards are taken as written. ``dynamic``: {position in the inputs (the target after them): dims}
    to capture symbolic; None: as the Plan's ``dynamic_shapes`` says (passes/frontend/capture_model.py)."""
    if loss_fn is not None and example_target is None:
        raise PlanError("loss_fn given without example_target", where="compile/plan arguments",
                        fix="pass example_target= (one global batch of targets)")
    keywords, inputs = batch_inputs(example_inputs)
    source = ModelSource(model=model, inputs=inputs, target=example_target, loss_fn=loss_fn, keywords=keywords,
                         own_loss=loss_fn is None and keywords is not None and LABELS in keywords, dynamic=dynamic)
    return capture_source(source, plan=plan, pinned=pinned, options=options)


def capture_source(source: ModelSource, *, plan: Plan, pinned: bool, options: CompileOptions) -> LoweringState:
    """The model phase of :func:`passes` on ``source`` under ``plan`` (autopar/shape_builder.py captures
    again through it, for a batch of another shape)."""
    return run_passes(LoweringState(plan=plan, pinned=pinned, options=options, source=source), _phase("model"))


def _rank_start(cap: LoweringState, *, tp_rank: int, dp_rank: int, copy: bool, only=None,
                cp_rank: int = 0) -> LoweringState:
    """The state a rank's lowering starts from: a copy of the captured graph (``copy``), this rank's place."""
    gm = deepcopy(cap.captured.gm) if copy else cap.captured.gm
    return replace(cap, gm=gm, coords={"dp": dp_rank, "tp": tp_rank, "cp": cp_rank}, only=only)


def shard_captured(cap: LoweringState, *, tp_rank: int, copy: bool = True,
                   dp_rank: int = 0, cp_rank: int = 0) -> tuple[LoweringState, VocabParallel]:
    """The shard phase of :func:`passes` alone (tensor, vocabulary and sequence parallelism), on a copy.

    Returns the state after it (its graph and what the passes found) and the vocabulary-parallel choice.
    """
    st = run_passes(_rank_start(cap, tp_rank=tp_rank, dp_rank=dp_rank, copy=copy, cp_rank=cp_rank), _phase("shard"))
    return st, st.vocab if st.vocab is not None else VocabParallel()


def lower_captured(cap: LoweringState, *, tp_rank: int, stages=None, copy: bool = True, dp_rank: int = 0,
                   cp_rank: int = 0) -> Lowered:
    """The rank phases of :func:`passes`: the stage graphs of tensor-parallel rank ``tp_rank``.

    ``copy``: transform a copy of the graph, so ``cap`` can be lowered again for another tp rank.
    ``stages``: build only these stage graphs (all when None); the Plan is the same either way.
    """
    only = None if stages is None or family(cap.plan.pipeline.schedule).replicas > 1 else tuple(sorted(set(stages)))
    st = run_passes(_rank_start(cap, tp_rank=tp_rank, dp_rank=dp_rank, copy=copy, only=only, cp_rank=cp_rank),
                    _phase("shard", "pipeline"))
    shapes = {n: tuple(a.shape) for n, a in zip(cap.captured.input_names, st.example_args)  # (cp: the rank's shard)
              if isinstance(a, torch.Tensor)}
    return Lowered(plan=_lowered_plan(st), captured=cap.captured, stages=list(st.stages), param_shards=dict(st.specs),
                   schedule=cap.schedule, tp_partial_grads=st.partial_grads, example_shapes=shapes)


def _shared_params(st: LoweringState) -> dict[str, tuple[int, ...]]:
    """{user name: stages holding it} of the weights more than one stage holds (replicas included)."""
    shared = st.shared
    if shared is None:  # every stage graph was built: read them
        shared = {user_name(name): tuple(g.stage for g in st.stages if name in g.param_names)
                  for name in sorted({n for g in st.stages for n in g.param_names})}  # same order on every rank
    return {k: v for k, v in shared.items() if len(v) > 1}


def _lowered_plan(st: LoweringState) -> Plan:
    """The Plan with what only the graph showed: stage starts, regions, shards, vocabulary, shared weights."""
    plan = st.plan
    return Plan(**{
        **dict(plan),
        "pipeline": plan.pipeline.model_copy(update={"stage_starts": tuple(user_name(u) for u in st.starts)}),
        "tp_regions": st.region_plans,
        "param_shards": {user_name(k): v for k, v in st.specs.items()},
        "vocab_parallel": tuple(user_name(p) for p in st.vocab.paths()) if st.vocab else (),
        "shared_params": _shared_params(st),
        "recompute": plan.recompute if any(m != "none" for m in plan.recompute) else (),
        "expert_params": tuple(user_name(t) for t in st.experts),
        "cp_inputs": st.cp_inputs,
        "cp_seq_len": st.cp_seq_len,
        "cp_label_shifts": st.cp_label_shifts,
        "cp_attention": st.cp_attention,
    })
