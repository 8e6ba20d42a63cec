"""The user's choices for :func:`autopar.compile` and :func:`autopar.plan`, and how they become a Plan.

:func:`resolve_plan` is the one place options turn into decisions, called once for a model on its way
through ``compile`` or ``plan`` (:func:`autopar.lowering.resolve`; the planner resolves the Plan it
chooses): the passes and the runtime read the Plan it returns, never the options. Every option is
declared once:

- :class:`~autopar.plan_model.PlanChoices`: recorded by the Plan as given (a new one is its field there,
  its validation, and the one pass or runtime part that reads ``plan.<field>``);
- :class:`~autopar.plan_model.RunOptions`: how the run behaves, carried by the Plan as ``plan.run``
  (a new one is its field there and the runtime part that reads it);
- :class:`~autopar.plan_model.AnalysisChoices`: what the analyses look for (the Plan records what they
  found);
- :class:`CompileOptions`' own fields: resolved into other decisions here, one line each (the
  schedule's stages per rank, microbatches, buckets, recompute per stage, sequence parallelism).

tests/api/test_plan_resolution.py holds every option to one of these.

    >>> plan = resolve_plan(CompileOptions(schedule="zb_v", zero_stage=0), given=None,
    ...                     mesh=MeshShape(pp=2), batch=8, model_name="m", num_parameters=10)
    >>> plan.pipeline.schedule, plan.pipeline.num_microbatches, plan.pipeline.num_virtual, plan.zero_stage
    ('zb_v', 4, 2, 0)
"""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from autopar.errors import PlanError
from autopar.plan_model import (AnalysisChoices, MeshShape, PipelinePlan, Plan, PlanChoices, RunOptions,
                                known_schedule)
from autopar.runtime.schedules.registry import default_stages_per_rank

__all__ = ["CompileOptions", "resolve_plan", "choose_microbatches", "choose_bucket_mb", "ANALYSIS_OPTIONS",
           "RUNTIME_OPTIONS"]

# the options the Plan records as given (PlanChoices), those that steer the analyses (the Plan records what they
# chose), and those of the run (the Plan carries them: Plan.run); every other one resolve_plan turns into decisions
PLAN_OPTIONS = tuple(PlanChoices.model_fields)
ANALYSIS_OPTIONS = tuple(AnalysisChoices.model_fields)
RUNTIME_OPTIONS = tuple(RunOptions.model_fields)


class CompileOptions(PlanChoices, AnalysisChoices, RunOptions):
    """Knobs a user may set; everything left ``None`` is decided by autopar.

    They arrive as keyword options of :func:`autopar.compile` / :func:`autopar.plan`; a bad or
    unknown one raises :class:`autopar.PlanError` naming the option. Most are declared once where the Plan
    holds them (:class:`~autopar.plan_model.PlanChoices`, :class:`~autopar.plan_model.RunOptions`) or next to
    them (:class:`~autopar.plan_model.AnalysisChoices`); these are the ones resolved into other decisions.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: str = "1f1b"
    num_microbatches: int | None = Field(None, ge=1)
    num_virtual: int | None = Field(None, ge=1)  # stages per pp rank; None: the schedule's own
    bucket_mb: float | None = Field(None, gt=0)  # DDP/ZeRO-1/2 gradient bucket size; None: choose_bucket_mb
    sequence_parallel: bool = False  # with tensor_parallel: norms/dropout/residuals sharded on the sequence
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation on every stage

    _known = field_validator("schedule")(known_schedule)


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


#: automatic bucket sizes: this many buckets per step, each within these bounds (MB)
BUCKETS_PER_STEP, MIN_BUCKET_MB, MAX_BUCKET_MB = 8, 1.0, 25.0


def choose_bucket_mb(*, num_parameters: int, mesh: MeshShape, requested: float | None) -> float:
    """The DDP/ZeRO-1/2 bucket size: the requested one, else an eighth of a rank's fp32 gradients.

    The last bucket's reduction cannot overlap backward, so it is the step's exposed tail: one
    bucket holding everything exposes all of it. Measured on a GPT 8x256 (24 MB of gradients,
    2 gloo ranks), a single 24 MB bucket (torch DDP's 25 MB default) left 28-40 ms of each step
    waiting after backward, 8 buckets of 3 MB 12-14 ms, 17 of 1.4 MB 17-20 ms (each call's own
    cost shows). The size stays between 1 MB and 25 MB (torch DDP's cap), so big models get
    torch's buckets. A rank's gradients: the parameters over pp x tp, 4 bytes each.
    """
    if requested is not None:
        return requested
    per_rank_mb = num_parameters * 4 / (mesh.pp * mesh.tp) / 2**20
    return round(min(MAX_BUCKET_MB, max(MIN_BUCKET_MB, per_rank_mb / BUCKETS_PER_STEP)), 3)


def resolve_plan(options: CompileOptions, *, given: Plan | None, mesh: MeshShape, batch: int, model_name: str,
                 num_parameters: int) -> Plan:
    """Every decision for this model: the ``given`` Plan's as written, else the options' (autopar's defaults).

    The :class:`~autopar.plan_model.PlanChoices` fields are taken as they are; the rest are decided here, one
    line each; ``run`` is always the options' (it belongs to the run). The passes then fill in what only the
    graph shows (stage starts when none are given, regions, shards, shared weights):
    :func:`autopar.lowering.lower_captured`.
    """
    g = given
    choices = {f: getattr(g if g else options, f) for f in PLAN_OPTIONS}
    schedule = g.pipeline.schedule if g else options.schedule
    num_virtual = g.pipeline.num_virtual if g else default_stages_per_rank(schedule, options.num_virtual)
    requested = g.pipeline.num_microbatches if g else options.num_microbatches
    if choices["data_parallel"] == "dataparallel":  # the rank-0 baseline: one stage, one pass, rank 0 steps
        schedule, num_virtual, requested, choices["zero_stage"] = "gpipe", 1, 1, 0  # (autopar/data_parallel.py)
    uniform = (options.recompute,) * (mesh.pp * num_virtual) if options.recompute != "none" else ()
    return Plan(
        **choices, model_name=model_name, mesh=mesh, global_batch_size=batch, num_parameters=num_parameters,
        pipeline=PipelinePlan(schedule=schedule, num_virtual=num_virtual,
                              num_microbatches=choose_microbatches(batch=batch, dp=mesh.dp, pp=mesh.pp,
                                                                   requested=requested),
                              stage_starts=g.pipeline.stage_starts if g else ()),
        tp_regions=g.tp_regions if g else (),
        param_shards=g.param_shards if g else {},  # (a given Plan's expert shards: passes/tp/tp_select.py)
        vocab_parallel=g.vocab_parallel if g else (),
        sequence_parallel=(g.sequence_parallel if g else options.sequence_parallel) and mesh.tp > 1
        and options.tensor_parallel,
        bucket_mb=g.bucket_mb if g else choose_bucket_mb(num_parameters=num_parameters, mesh=mesh,
                                                         requested=options.bucket_mb),
        recompute=(g.recompute if g else ()) or uniform,  # a Plan without modes takes the option's on every stage
        # the bound's source (the lowering writes the bound it finds, and from where, over the option's)
        max_seq_len_source=g.max_seq_len_source if g else ("max_seq_len" if options.max_seq_len else ""),
        dynamic_dims=g.dynamic_dims if g else (),  # (what the capture keeps symbolic: the lowering fills it in)
        run=RunOptions(**{f: getattr(options, f) for f in RUNTIME_OPTIONS}),
    )
