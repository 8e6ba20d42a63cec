"""autopar's error types: one base class, one subclass per kind of failure.

Every message says what is wrong, where (node, module path, rank, stage) and what to do.
Build messages with :func:`format_error` so they read the same everywhere.
"""
from __future__ import annotations

__all__ = [
    "AutoparError",
    "CaptureError",
    "PlanError",
    "InputError",
    "ShardingError",
    "ScheduleError",
    "RuntimeCommError",
    "NumericsError",
    "IndexRangeError",
    "CheckpointError",
    "PassError",
    "format_error",
]


def format_error(what: str, *, where: str | None = None, fix: str | None = None) -> str:
    """Join the three parts of a user-facing message: what is wrong, where, what to do."""
    parts = [what.rstrip(".") + "."]
    if where:
        parts.append(f"Where: {where}.")
    if fix:
        parts.append(f"Fix: {fix.rstrip('.')}.")
    return " ".join(parts)


class AutoparError(Exception):
    """Base class of every error autopar raises for a user's input or environment."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(format_error(what, where=where, fix=fix))


class CaptureError(AutoparError):
    """The model could not be captured as a graph (tracer failure, unsupported construct)."""


class PlanError(AutoparError):
    """The mesh, the config or the Plan does not fit the model or the world."""


class InputError(PlanError):
    """An argument is of the wrong kind or shape: a non-tensor input, a function for a module, batches that disagree."""


class ShardingError(AutoparError):
    """A tensor-parallel sharding cannot be applied (indivisible dims, missing rule)."""


class ScheduleError(AutoparError):
    """A pipeline schedule is malformed, deadlocks or does not fit the stages and microbatches."""


class RuntimeCommError(AutoparError):
    """A failure while training: a collective timed out, a peer failed, a NaN appeared."""


class NumericsError(RuntimeCommError):
    """A NaN or inf in the loss or the gradients; names the step, the stage and the tensor."""


class IndexRangeError(RuntimeCommError):
    """An index input (token ids, positions) leaves the table it looks up; names the rank, stage, input and bound."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


class PassError(AutoparError):
    """A compiler pass broke the graph; names the pass and the passes that ran before it."""
