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
    capture: Literal["export", "symbolic_trace"] = "export"
    tensor_parallel: bool = True
    p2p_timeout_s: float = Field(300.0, gt=0)

    @field_validator("schedule")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {value!r}; use one of {', '.join(SCHEDULE_NAMES)}")
        return value
