"""The user's choices for :func:`autopar.compile` and :func:`autopar.plan`, and how they become a Plan.

:func:`resolve_plan` is the one place options turn into decisions: the lowering reads the Plan it
returns and no option the Plan holds. A new option the Plan records is a field here, a field of
the Plan, one line of :func:`resolve_plan` and a test (tests/api/test_plan_resolution.py); an
option that only steers an analysis (``tensor_parallel``, ``vocab_parallel``, ``block_capture``)
or the runtime (``p2p_timeout_s``, ``max_grad_norm``, ``pipemare_*``) is a field here alone.

    >>> plan = resolve_plan(CompileOptions(schedule="zb_v", zero_stage=0), given=None,
    ...                     mesh=MeshShape(pp=2), batch=8, model_name="m", num_parameters=10)
    >>> plan.pipeline.schedule, plan.pipeline.num_microbatches, plan.pipeline.num_virtual, plan.zero_stage
    ('zb_v', 4, 2, 0)
"""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from autopar.errors import PlanError
from autopar.plan_model import MeshShape, PipelinePlan, Plan, UserModel, known_schedule
from autopar.runtime.schedules.registry import default_stages_per_rank

__all__ = ["CompileOptions", "resolve_plan", "choose_microbatches", "choose_bucket_mb", "ANALYSIS_OPTIONS",
           "RUNTIME_OPTIONS"]

# the options the Plan does not record (every other one resolves into it: resolve_plan)
ANALYSIS_OPTIONS = ("tensor_parallel", "vocab_parallel", "block_capture")  # steer what the analyses look for
RUNTIME_OPTIONS = ("p2p_timeout_s", "max_grad_norm", "pipemare_lr_warmup_updates", "pipemare_correction_decay",
                   "flight_record", "run_dir", "optimizer_params")


class CompileOptions(UserModel):
    """Knobs a user may set; everything left ``None`` is decided by autopar.

    They arrive as keyword options of :func:`autopar.compile` / :func:`autopar.plan`; a bad or
    unknown one raises :class:`autopar.PlanError` naming the option.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: str = "1f1b"
    num_microbatches: int | None = Field(None, ge=1)
    num_virtual: int | None = Field(None, ge=1)  # stages per pp rank; None: the schedule's own
    zero_stage: int = Field(1, ge=0, le=3)
    data_parallel: Literal["ddp", "dataparallel"] = "ddp"  # dataparallel: the rank-0 baseline (pp=1)
    bucket_mb: float | None = Field(None, gt=0)  # DDP/ZeRO-1/2 gradient bucket size; None: choose_bucket_mb
    capture: Literal["export", "symbolic_trace"] = "export"
    tensor_parallel: bool = True
    # with tensor_parallel: embedding, LM head and loss sharded on the vocabulary. None: where the vocabulary
    # divides by tp (else replicated, with a warning); True: required (ShardingError if it does not divide)
    vocab_parallel: bool | None = None
    sequence_parallel: bool = False  # with tensor_parallel: norms/dropout/residuals sharded on the sequence
    p2p_timeout_s: float = Field(300.0, gt=0)
    flight_record: int = Field(4096, ge=0, description=(
        "entries of each rank's flight record (its last actions, collectives and transfers), read by the "
        "job-wide diagnosis when a collective or a transfer fails; `0` turns the record, the heartbeats, the "
        "diagnosis and the straggler warnings off ([errors.md](errors.md#when-a-job-hangs-or-a-rank-dies))"))
    run_dir: str | None = Field(None, description=(
        "a folder for the run's files: each rank's flight record (kept when a rank is killed) and the job-wide "
        "diagnosis (`diagnosis.txt`, read again by `autopar diagnose RUN_DIR`); `None`: the diagnosis goes to "
        "the log only"))
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation on every stage
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: bf16 compute, fp32 master weights and gradients
    # identical blocks (a long ModuleList): "once" captures a few and repeats the last, "every" captures all,
    # "auto" is "once" for models on the meta device with 8 or more identical blocks (passes/block_template.py)
    block_capture: Literal["auto", "once", "every"] = "auto"
    expert_parallel: int = Field(1, ge=1, description=(
        "split each mixture-of-experts layer's experts over this many ranks carved out of dp; tokens move "
        "by all-to-all ([moe.md](moe.md))"))
    moe_capacity_factor: float | None = Field(None, gt=0, description=(
        "with expert_parallel: each expert takes at most ceil(factor * rows / experts) rows from each rank, "
        "the rest are dropped and counted; `None`: dropless ([moe.md](moe.md))"))
    max_grad_norm: float | None = Field(None, gt=0)  # clip by the global gradient norm over every shard
    optimizer_params: Literal["params", "named"] = Field("params", description=(
        "what the `optimizer` factory receives: `params`, a list of parameters, or `named`, the "
        "`(name, parameter)` pairs `model.named_parameters()` gives, to build parameter groups by name; either "
        "way once, as stand-ins of the whole model, and each group holds for every shard of its parameters "
        "([training_loop.md](training_loop.md))"))
    pipemare_lr_warmup_updates: int = Field(100, ge=0, description=(
        "`pipemare` only: updates over which each stage's learning rate grows from lr / delay to lr "
        "(0: no rescheduling) ([schedules.md](schedules.md))"))
    pipemare_correction_decay: float = Field(0.5, ge=0, lt=1, description=(
        "`pipemare` only: decay of the average weight change per update that corrects the backward's "
        "weights toward the forward's ([schedules.md](schedules.md))"))

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

    The passes then fill in what only the graph shows (stage starts when none are given, regions,
    shards, shared weights): :func:`autopar.lowering.lower_captured`.
    """
    g = given
    schedule = g.pipeline.schedule if g else options.schedule
    num_virtual = g.pipeline.num_virtual if g else default_stages_per_rank(schedule, options.num_virtual)
    requested = g.pipeline.num_microbatches if g else options.num_microbatches
    uniform = (options.recompute,) * (mesh.pp * num_virtual) if options.recompute != "none" else ()
    return Plan(
        model_name=model_name, mesh=mesh, global_batch_size=batch, num_parameters=num_parameters,
        pipeline=PipelinePlan(schedule=schedule, num_virtual=num_virtual,
                              num_microbatches=choose_microbatches(batch=batch, dp=mesh.dp, pp=mesh.pp,
                                                                   requested=requested),
                              stage_starts=g.pipeline.stage_starts if g else ()),
        tp_regions=g.tp_regions if g else (),
        param_shards=g.param_shards if g else {},  # (a given Plan's expert shards: lowering._select_experts)
        vocab_parallel=g.vocab_parallel if g else (),
        sequence_parallel=(g.sequence_parallel if g else options.sequence_parallel) and mesh.tp > 1
        and options.tensor_parallel,
        zero_stage=g.zero_stage if g else options.zero_stage,
        data_parallel=g.data_parallel if g else options.data_parallel,
        bucket_mb=g.bucket_mb if g else choose_bucket_mb(num_parameters=num_parameters, mesh=mesh,
                                                         requested=options.bucket_mb),
        capture=g.capture if g else options.capture,
        recompute=(g.recompute if g else ()) or uniform,  # a Plan without modes takes the option's on every stage
        precision=g.precision if g else options.precision,
        expert_parallel=g.expert_parallel if g else options.expert_parallel,
        moe_capacity_factor=g.moe_capacity_factor if g else options.moe_capacity_factor,
    )
