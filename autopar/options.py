"""The user's choices for :func:`autopar.compile` and :func:`autopar.plan`, validated by pydantic."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from autopar.plan_model import SCHEDULE_NAMES, UserModel

__all__ = ["CompileOptions"]


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
    bucket_mb: float = Field(25.0, gt=0)  # DDP/ZeRO-1/2 gradient bucket size, reduced while backward runs
    capture: Literal["export", "symbolic_trace"] = "export"
    tensor_parallel: bool = True
    # with tensor_parallel: embedding, LM head and loss sharded on the vocabulary. None: where the vocabulary
    # divides by tp (else replicated, with a warning); True: required (ShardingError if it does not divide)
    vocab_parallel: bool | None = None
    sequence_parallel: bool = False  # with tensor_parallel: norms/dropout/residuals sharded on the sequence
    p2p_timeout_s: float = Field(300.0, gt=0)
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
    pipemare_lr_warmup_updates: int = Field(100, ge=0, description=(
        "`pipemare` only: updates over which each stage's learning rate grows from lr / delay to lr "
        "(0: no rescheduling) ([schedules.md](schedules.md))"))
    pipemare_correction_decay: float = Field(0.5, ge=0, lt=1, description=(
        "`pipemare` only: decay of the average weight change per update that corrects the backward's "
        "weights toward the forward's ([schedules.md](schedules.md))"))

    @field_validator("schedule")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {value!r}; use one of {', '.join(SCHEDULE_NAMES)}")
        return value
