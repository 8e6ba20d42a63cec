"""The Plan: every decision autopar made for one model on one mesh, as a validated pydantic model.

It round-trips through JSON (``Plan.model_validate_json(plan.model_dump_json())``), prints a
short human summary, and may be edited and handed back to :func:`autopar.compile` /
:func:`autopar.plan` (``plan=``): stage starts, schedule, microbatches, ZeRO stage and the
tensor-parallel regions are taken from it as written.
"""
from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from autopar.errors import PlanError
from autopar.ir.shard_layout import ShardLayout
from autopar.parallel_dims import MESH_AXES, ParallelDims
from autopar.runtime.schedules.registry import schedule_names

__all__ = ["MeshShape", "PipelinePlan", "TpRegionPlan", "DynamicDimPlan", "Plan", "PlanChoices", "RunOptions",
           "AnalysisChoices", "MESH_AXES", "UserModel", "plan_error_from", "known_schedule"]


def known_schedule(value: str) -> str:
    """A pydantic validator: ``value`` if the registry (runtime/schedules/registry.py) has it."""
    if value not in schedule_names():
        raise ValueError(f"unknown schedule {value!r}; use one of {', '.join(schedule_names())}")
    return value


def _what_and_fix(error: dict, field: str, known: list[str]) -> tuple[str, str]:
    """One pydantic error as (what is wrong, what to do); our validators write 'problem; fix'."""
    msg = error["msg"]
    if error["type"] == "value_error":
        problem, _, fix = msg.removeprefix("Value error, ").partition("; ")
        return problem, fix or f"change {field!r}"
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(field, known, n=3)  # the likeliest spellings first, then the rest
        known_text = f" (known: {', '.join(dict.fromkeys(close + known))})" if known else ""
        return f"unknown field {field!r}", f"remove {field!r} or fix its spelling{known_text}"
    if error["type"] == "json_invalid":
        return msg, "pass the JSON text written by plan.model_dump_json(), edited by hand"
    if error["type"] == "missing":
        return msg, f"give {field!r}"
    return msg, f"set {field!r} so that: {msg[:1].lower()}{msg[1:]}"


def plan_error_from(exc: ValidationError, model: type[BaseModel]) -> PlanError:
    """pydantic's ValidationError as a PlanError naming every bad field, its value and a fix."""
    owner = model.__name__
    what, where, fix = [], [], []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "<root>"
        top_level = list(model.model_fields) if len(error["loc"]) == 1 else []
        problem, remedy = _what_and_fix(error, field, top_level)
        what.append(f"{field}: {problem}")
        where.append(f"{owner}.{field} (got {repr(error.get('input'))[:60]})")
        fix.append(remedy)
    return PlanError(f"invalid {owner}: " + "; ".join(what), where=", ".join(where), fix="; ".join(fix))


class _RaisesPlanError(type(BaseModel)):
    """Metaclass: constructing a model converts pydantic's ValidationError into a PlanError.

    (Overriding ``__init__`` instead would make pydantic call it for every nested model, which
    loses the path of a nested field such as ``Plan.pipeline.schedule``.)
    """

    def __call__(cls, /, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            raise plan_error_from(exc, cls) from None


class UserModel(BaseModel, metaclass=_RaisesPlanError):
    """A pydantic model users build or load: invalid input raises :class:`PlanError`, not pydantic's error.

    Construction and ``model_validate`` / ``model_validate_json`` / ``model_validate_strings`` are
    all covered; pydantic still does the validating.
    """

    @classmethod
    def model_validate(cls, *args, **kwargs):
        try:
            return super().model_validate(*args, **kwargs)
        except ValidationError as exc:
            raise plan_error_from(exc, cls) from None

    @classmethod
    def model_validate_json(cls, *args, **kwargs):
        try:
            return super().model_validate_json(*args, **kwargs)
        except ValidationError as exc:
            raise plan_error_from(exc, cls) from None

    @classmethod
    def model_validate_strings(cls, *args, **kwargs):
        try:
            return super().model_validate_strings(*args, **kwargs)
        except ValidationError as exc:
            raise plan_error_from(exc, cls) from None


class _Frozen(UserModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MeshShape(_Frozen):
    """Degrees of the mesh axes (``cp``: context parallelism, the sequence cut over ranks); the world size is
    their product."""

    dp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dims(self) -> ParallelDims:
        """These degrees as :class:`~autopar.parallel_dims.ParallelDims` (no expert parallelism)."""
        return ParallelDims.of(self)

    def __str__(self) -> str:
        return self.dims.mesh_text()

    @model_serializer(mode="wrap")
    def _without_unit_cp(self, handler):
        """``cp`` is written only when it is used: a Plan or shape without cp reads as it always did."""
        data = handler(self)
        if data.get("cp") == 1:
            data.pop("cp")
        return data


class PipelinePlan(_Frozen):
    """Schedule, microbatches and where each stage after the first begins (a pipeline unit)."""

    schedule: str = "1f1b"
    num_microbatches: int = Field(1, ge=1)
    num_virtual: int = Field(1, ge=1)
    stage_starts: tuple[str, ...] = ()

    _known_schedule = field_validator("schedule")(known_schedule)


class TpRegionPlan(_Frozen):
    """One tensor-parallel region: its column-parallel and row-parallel linears (module paths).

    ``gathered``: columns no row closes, their output all-gathered (passes/tp/tp_gather_output.py).
    """

    columns: tuple[str, ...]
    rows: tuple[str, ...]
    gathered: tuple[str, ...] = ()


class PlanChoices(_Frozen):
    """The options the Plan records as they are given: each a field here, once. :class:`Plan` and
    :class:`autopar.options.CompileOptions` both have them, and :func:`autopar.options.resolve_plan` takes a
    given Plan's, else the options'. A new such option is a field here (its constraints its validation;
    what it needs of the mesh in autopar/validation.py) and the one pass or runtime part that reads it."""

    zero_stage: int = Field(1, ge=0, le=3)
    data_parallel: Literal["ddp", "dataparallel"] = "ddp"  # dataparallel: the rank-0 baseline (pp=1)
    capture: Literal["export", "symbolic_trace"] = "export"
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: bf16 compute, fp32 master weights and gradients
    expert_parallel: int = Field(1, ge=1, description=(
        "split each mixture-of-experts layer's experts over this many ranks carved out of dp; tokens move "
        "by all-to-all ([moe.md](moe.md))"))
    moe_capacity_factor: float | None = Field(None, gt=0, description=(
        "with expert_parallel: each expert takes at most ceil(factor * rows / experts) rows from each rank, "
        "the rest are dropped and counted; `None`: dropless ([moe.md](moe.md))"))
    dynamic_shapes: Literal["auto", "seq", "static"] = Field("auto", description=(
        "batches of other shapes than the example's: `auto` recaptures once, at the first other sequence length "
        "or row count, with the dims that changed symbolic; `seq` captures the sequence dim symbolic from the "
        "start; `static` compiles each new shape on its own ([batches.md](batches.md))"))
    max_seq_len: int | None = Field(None, ge=1, description=(
        "the longest sequence a batch may hold; `None`: the model's own maximum (its config's "
        "max_position_embeddings, its position table) ([batches.md](batches.md))"))
    cp_strategy: Literal["auto", "ring", "all_to_all"] = Field("auto", description=(
        "with a cp mesh dim: how each attention meets the keys of other ranks: `ring` passes K/V blocks "
        "around the cp ranks, `all_to_all` (Ulysses) trades sequence shards for head shards, `auto` takes "
        "the all-to-all where the heads divide by cp, else the ring ([context_parallel.md](context_parallel.md))"))
    cp_load_balanced: bool = Field(True, description=(
        "with a cp mesh dim: each rank holds chunks i and 2cp-1-i of the sequence (equal causal work; the "
        "sequence divides by 2 x cp), else one contiguous chunk ([context_parallel.md](context_parallel.md))"))


class DynamicDimPlan(_Frozen):
    """A batch dim the graphs keep symbolic: the inputs carrying it and the sizes a batch may take."""

    label: str  # "seq" (dim 1), "rows" (dim 0)
    inputs: tuple[tuple[str, int], ...]  # (input name, tensor dim)
    low: int = Field(1, ge=1)
    high: int | None = Field(None, ge=1)  # the bound; None: none known
    multiple_of: int = Field(1, ge=1)  # sequence parallelism splits the sequence over tp
    bound_source: str = ""

    def describe(self) -> str:
        where = ", ".join(name for name, _ in self.inputs)
        high = "no bound" if self.high is None else str(self.high)
        source = f" ({self.bound_source})" if self.bound_source and self.high is not None else ""
        extra = f", a multiple of {self.multiple_of}" if self.multiple_of > 1 else ""
        return f"{self.label} (dim {self.inputs[0][1]} of {where}) {self.low}..{high}{source}{extra}"


class AnalysisChoices(_Frozen):
    """The options that steer what the lowering's analyses look for; the Plan records what they chose (the
    regions, the vocabulary shards, the captured blocks), not the options."""

    tensor_parallel: bool = True
    # with tensor_parallel: embedding, LM head and loss sharded on the vocabulary. None: where the vocabulary
    # divides by tp (else replicated, with a warning); True: required (ShardingError if it does not divide)
    vocab_parallel: bool | None = None
    # identical blocks (a long ModuleList): "once" captures a few and repeats the last, "every" captures all,
    # "auto" is "once" for models on the meta device with 8 or more identical blocks (passes/frontend/block_template.py)
    block_capture: Literal["auto", "once", "every"] = "auto"


class RunOptions(_Frozen):
    """How this run behaves, carried by the Plan (``Plan.run``) to the runtime, which reads it there: always
    the call's options (a given Plan's are replaced: they belong to the run, not to the decisions). A new
    run option is a field here and the runtime part that reads ``plan.run``."""

    p2p_timeout_s: float = Field(300.0, gt=0)
    flight_record: int = Field(4096, ge=0, description=(
        "entries of each rank's flight record (its last actions, collectives and transfers), read by the "
        "job-wide diagnosis when a collective or a transfer fails; `0` turns the record, the heartbeats, the "
        "diagnosis and the straggler warnings off ([errors.md](errors.md#when-a-job-hangs-or-a-rank-dies))"))
    run_dir: str | None = Field(None, description=(
        "a folder for the run's files: each rank's flight record (kept when a rank is killed) and the job-wide "
        "diagnosis (`diagnosis.txt`, read again by `autopar diagnose RUN_DIR`); `None`: the diagnosis goes to "
        "the log only"))
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
    shape_cache_size: int = Field(8, ge=1, description=(
        "how many batch shapes compiled on their own (dims that cannot stay symbolic) are kept, least recently "
        "used dropped first ([batches.md](batches.md))"))


class Plan(PlanChoices):
    """Everything decided for one model on one mesh (the :class:`PlanChoices` fields among them), and how
    this run behaves (``run``)."""

    model_name: str = "model"
    mesh: MeshShape = MeshShape()
    global_batch_size: int = Field(ge=1)
    pipeline: PipelinePlan = PipelinePlan()
    tp_regions: tuple[TpRegionPlan, ...] = ()
    param_shards: dict[str, ShardLayout] = {}  # parameters sharded over tp: how each is cut (ir/shard_layout.py)
    vocab_parallel: tuple[str, ...] = ()  # module paths of the embedding(s) and LM head sharded on the vocabulary
    sequence_parallel: bool = False
    shared_params: dict[str, tuple[int, ...]] = {}
    bucket_mb: float = Field(25.0, gt=0)
    num_parameters: int = Field(0, ge=0)
    recompute: tuple[Literal["none", "selective", "full"], ...] = ()  # per stage; () = "none" everywhere
    expert_params: tuple[str, ...] = ()  # the expert tensors each rank holds 1/ep of (dim 0)
    # the lowering fills these in (autopar/lowering.py): max_seq_len becomes the bound, from where it says
    max_seq_len_source: str = ""  # the bound's source: "max_seq_len" (the user's option), the model's config, ...
    dynamic_dims: tuple[DynamicDimPlan, ...] = ()  # the dims the graphs keep symbolic (filled by the capture)
    # with cp: the inputs the runtime cuts on the sequence, (name, dim), and the whole length (the lowering's)
    cp_inputs: tuple[tuple[str, int], ...] = ()
    cp_seq_len: int = Field(0, ge=0)
    cp_label_shifts: tuple[tuple[str, int, float], ...] = ()  # (input, k, fill): shifted left by k before the cut
    cp_attention: tuple[tuple[str, Literal["ring", "all_to_all"]], ...] = ()  # (module path, strategy) per attention
    run: RunOptions = RunOptions()

    @property
    def dims(self) -> ParallelDims:
        """Every degree of the Plan, expert parallelism's included: what the passes and the runtime ask."""
        return ParallelDims.of(self.mesh, ep=self.expert_parallel)

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        self.dims  # the degrees together (expert_parallel divides dp): autopar/parallel_dims.py
        pp, m = self.mesh.pp, self.pipeline.num_microbatches
        starts = self.pipeline.stage_starts
        stages = pp * self.pipeline.num_virtual
        if starts and len(starts) != stages - 1:
            raise PlanError(f"{len(starts)} stage starts given for {stages} stages",
                            where="Plan.pipeline.stage_starts",
                            fix=f"give exactly {stages - 1} unit names (one per stage after the first), "
                                f"or () to let autopar choose")
        if self.recompute and len(self.recompute) != stages:
            raise PlanError(f"{len(self.recompute)} recompute modes given for {stages} stages",
                            where="Plan.recompute",
                            fix=f"give exactly {stages} modes (one per stage: none, selective or full), "
                                f"or () for none")
        if self.global_batch_size % (self.mesh.dp * m) != 0:
            raise PlanError(f"global batch {self.global_batch_size} is not divisible by "
                            f"dp={self.mesh.dp} x microbatches={m}",
                            where="Plan.global_batch_size, Plan.mesh.dp, Plan.pipeline.num_microbatches",
                            fix=f"use a global batch that is a multiple of {self.mesh.dp * m}, "
                                f"or change num_microbatches or dp")
        return self

    def _shapes_line(self) -> str:
        """Which batch dims may change per step, and up to what."""
        source = f" ({self.max_seq_len_source})" if self.max_seq_len_source else ""
        bound = f", sequences up to {self.max_seq_len}{source}" if self.max_seq_len else ""
        if self.dynamic_dims:
            return "  dynamic dims: " + "; ".join(d.describe() for d in self.dynamic_dims)
        if self.dynamic_shapes == "static":
            return f"  shapes: each new batch shape compiled on its own (dynamic_shapes=static){bound}"
        return (f"  shapes: the example's; the first other length or row count recaptures once with those dims "
                f"symbolic (dynamic_shapes=auto){bound}")

    @property
    def microbatch_size(self) -> int:
        return self.global_batch_size // (self.mesh.dp * self.pipeline.num_microbatches)

    def _cp_attention_counts(self) -> str:
        """``": ring x2, all_to_all x1"``: what cp_strategy resolved to, per strategy (empty before lowering)."""
        counts: dict[str, int] = {}
        for _, strategy in self.cp_attention:
            counts[strategy] = counts.get(strategy, 0) + 1
        return (": " + ", ".join(f"{s} x{n}" for s, n in counts.items())) if counts else ""

    def summary(self) -> str:
        """A few lines a person reads before launching."""
        p = self.pipeline
        lines = [
            f"Plan for {self.model_name}: {self.mesh} = {self.mesh.world_size} ranks, "
            f"{self.num_parameters:,} parameters",
            f"  batch {self.global_batch_size} = dp {self.mesh.dp} x {p.num_microbatches} microbatches "
            f"x {self.microbatch_size}",
            f"  pipeline: {p.schedule}, {self.mesh.pp * p.num_virtual} stages"
            + (f", stages start at {', '.join(p.stage_starts)}" if p.stage_starts else ""),
            f"  tensor parallel: {len(self.tp_regions)} regions, {len(self.param_shards)} sharded parameters"
            + (f"; vocabulary-parallel {', '.join(self.vocab_parallel)}" if self.vocab_parallel else "")
            + ("; sequence parallel" if self.sequence_parallel else ""),
            f"  ZeRO stage {self.zero_stage} over {'dp x cp' if self.mesh.cp > 1 else 'dp'} "
            f"({self.data_parallel}, {self.bucket_mb:g} MB buckets); "
            f"capture with {self.capture}",
        ]
        if self.recompute or self.precision != "fp32":
            lines.append(f"  recompute per stage: {', '.join(self.recompute) or 'none'}; precision {self.precision}")
        if self.mesh.cp > 1:
            lines.append(f"  context parallel: the sequence cut over cp={self.mesh.cp} "
                         f"({'load-balanced' if self.cp_load_balanced else 'contiguous'}), attention by "
                         f"{self.cp_strategy}{self._cp_attention_counts()}; gradients summed over dp x cp = "
                         f"{self.dims.dcp}")
        if self.expert_parallel > 1:
            lines.append(f"  expert parallel: {len(self.expert_params)} expert tensors split over ep="
                         f"{self.expert_parallel} (of dp {self.mesh.dp})")
        lines.append(self._shapes_line())
        if self.shared_params:
            shared = ", ".join(f"{k} on stages {list(v)}" for k, v in self.shared_params.items())
            lines.append(f"  shared across stages (gradients summed): {shared}")
        return "\n".join(lines)
