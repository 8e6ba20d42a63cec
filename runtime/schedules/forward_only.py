"""Forward-only (inference) schedules: every microbatch through the stages, no backward, nothing kept.

:func:`forward_only` derives the inference schedule of a training schedule: the same stages on
the same ranks, each rank running the forwards of its stages microbatch by microbatch (depth
first), so a rank never holds more than the microbatch it is working on. A schedule with two
replicas (Chimera) runs every microbatch through replica 0. The executor runs it with autograd off.

    >>> from autopar.runtime.schedules.interleaved import interleaved_1f1b
    >>> print(forward_only(interleaved_1f1b(num_ranks=2, num_microbatches=2, num_virtual=2)).to_csv(), end="")
    0F0,2F0,0F1,2F1
    1F0,3F0,1F1,3F1
"""
from __future__ import annotations

from autopar.runtime.schedules._common import F, check_count
from autopar.runtime.schedules.action import Schedule

__all__ = ["forward_only"]


def forward_only(schedule: Schedule, *, num_microbatches: int | None = None) -> Schedule:
    """The inference schedule on ``schedule``'s stage placement (``num_microbatches`` defaults to its own)."""
    m = check_count("forward_only", "num_microbatches",
                    schedule.num_microbatches if num_microbatches is None else num_microbatches)
    chain = range(schedule.parts)  # replica 0
    rows = [[F(s, i) for i in range(m) for s in chain if schedule.stage_to_rank[s] == r]
            for r in range(schedule.num_ranks)]
    return Schedule(
        name=f"{schedule.name}:forward_only", num_ranks=schedule.num_ranks, num_stages=schedule.num_stages,
        num_microbatches=m, stage_to_rank=schedule.stage_to_rank, actions=tuple(map(tuple, rows)),
        num_replicas=schedule.num_replicas,
        microbatch_replica=(0,) * m if schedule.num_replicas > 1 else (), forward_only=True,
    )
