"""The Plan: every decision autopar made for one model on one mesh, as a validated pydantic model.

It round-trips through JSON (``Plan.model_validate_json(plan.model_dump_json())``), prints a
short human summary, and may be edited and handed back to :func:`autopar.compile` /
:func:`autopar.plan` (``plan=``): stage starts, schedule, microbatches, ZeRO stage and the
tensor-parallel regions are taken from it as written.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["MeshShape", "PipelinePlan", "TpRegionPlan", "ParamShard", "Plan", "MESH_AXES",
           "SCHEDULE_NAMES"]

MESH_AXES = ("dp", "pp", "tp")
SCHEDULE_NAMES = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zb_v")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MeshShape(_Frozen):
    """Degrees of the three mesh axes; the world size is their product."""

    dp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp}"


class PipelinePlan(_Frozen):
    """Schedule, microbatches and where each stage after the first begins (a pipeline unit)."""

    schedule: str = "1f1b"
    num_microbatches: int = Field(1, ge=1)
    num_virtual: int = Field(1, ge=1)
    stage_starts: tuple[str, ...] = ()

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        if value not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {value!r}; known: {', '.join(SCHEDULE_NAMES)}")
        return value


class TpRegionPlan(_Frozen):
    """One tensor-parallel region: its column-parallel and row-parallel linears (module paths)."""

    columns: tuple[str, ...]
    rows: tuple[str, ...]


class ParamShard(_Frozen):
    """A parameter sharded over tp: on ``dim``, in ``chunks`` equal blocks each sharded."""

    dim: int = Field(ge=0)
    chunks: int = Field(1, ge=1)


class Plan(_Frozen):
    """Everything decided for one model on one mesh."""

    model_name: str = "model"
    mesh: MeshShape = MeshShape()
    global_batch_size: int = Field(ge=1)
    pipeline: PipelinePlan = PipelinePlan()
    tp_regions: tuple[TpRegionPlan, ...] = ()
    param_shards: dict[str, ParamShard] = {}
    shared_params: dict[str, tuple[int, ...]] = {}
    zero_stage: int = Field(1, ge=0, le=3)
    capture: Literal["export", "symbolic_trace"] = "export"
    num_parameters: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        pp, m = self.mesh.pp, self.pipeline.num_microbatches
        starts = self.pipeline.stage_starts
        if starts and len(starts) != pp * self.pipeline.num_virtual - 1:
            raise ValueError(f"{len(starts)} stage starts given for "
                             f"{pp * self.pipeline.num_virtual} stages; need one fewer than the stages")
        if self.global_batch_size % (self.mesh.dp * m) != 0:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by "
                             f"dp={self.mesh.dp} x microbatches={m}")
        return self

    @property
    def microbatch_size(self) -> int:
        return self.global_batch_size // (self.mesh.dp * self.pipeline.num_microbatches)

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
            f"  tensor parallel: {len(self.tp_regions)} regions, {len(self.param_shards)} sharded parameters",
            f"  ZeRO stage {self.zero_stage} over dp; capture with {self.capture}",
        ]
        if self.shared_params:
            shared = ", ".join(f"{k} on stages {list(v)}" for k, v in self.shared_params.items())
            lines.append(f"  shared across stages (gradients summed): {shared}")
        return "\n".join(lines)
