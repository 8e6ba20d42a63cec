"""The schedules the planner reads, built once per shape: stage placement, in-flight peaks, whole step.

The cost model asks the same few questions of a schedule for thousands of candidates: which rank runs
each stage, how many microbatches each rank holds at its peak (:func:`schedule_of`), the whole step's
action lists to simulate (:func:`full_schedule`) and each rank's stages (:func:`stages_of`). Each answer
is cached by the schedule's shape (family, pp, microbatches, virtual stages).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autopar.memory.activations import peak_bytes
from autopar.runtime.schedules.registry import build_schedule, family, splits_backward
from autopar.runtime.schedules.validator import validate

__all__ = ["schedule_of", "full_schedule", "stages_of"]


@dataclass(frozen=True)
class _Shape:
    """What the cost model needs of a schedule too long to build: stage placement and backward split."""

    stage_to_rank: tuple[int, ...]
    split_backward: bool
    actions: None = None


def _closed_form(name: str, pp: int, m: int, v: int):
    """Stage placement and in-flight peaks from the family's closed form, without building the schedule."""
    form = family(name).closed_form
    counts = form.peaks(pp, m, v)
    return _Shape(form.placement(pp, v), splits_backward(name)), tuple(counts)


@lru_cache(maxsize=16)
def full_schedule(name: str, pp: int, m: int, v: int):
    """The whole schedule of a step, built and validated once for every candidate simulated on it."""
    schedule = build_schedule(name, num_ranks=pp, num_microbatches=m, num_virtual=v)
    validate(schedule)
    return schedule


@lru_cache(maxsize=512)
def schedule_of(name: str, pp: int, m: int, v: int):
    """A (cached) schedule for ``name`` and the microbatches each rank keeps in flight at its peak.

    Every family but GPipe reaches its steady state by ``2·pp`` microbatches, so a longer schedule is
    represented by that one (same stage placement, same peaks); GPipe holds all ``m``. Deep
    pipelines of the common families use their closed forms instead (no action list).
    """
    row = family(name)
    if pp > 8 and row.closed_form is not None and row.replicas == 1 and not row.asynchronous:
        return _closed_form(name, pp, m, v)
    short = m if m <= 2 * pp else 2 * pp  # (fewer microbatches than ranks: the generator refuses or runs them)
    schedule = build_schedule(name, num_ranks=pp, num_microbatches=short, num_virtual=v)
    split = schedule.split_backward
    counts = tuple(peak_bytes(row, {s: 1 for s in range(schedule.num_stages)}, split_backward=split)
                   for row in schedule.actions)
    if row.peak_grows:
        counts = tuple(c * m // short for c in counts)
    return schedule, counts


@lru_cache(maxsize=1024)
def stages_of(owner: tuple[int, ...], pp: int) -> tuple[tuple[int, ...], ...]:
    """For each pp rank, the stages it runs (in order), from ``owner`` (stage -> rank)."""
    stages = [[] for _ in range(pp)]
    for s, q in enumerate(owner):
        stages[q].append(s)
    return tuple(tuple(row) for row in stages)
