"""Stage boundaries for devices of different speed and memory: balanced cuts, weighted.

:func:`autopar.passes.pipeline.partition.balanced_cuts` minimises the largest stage cost when every stage
runs on the same kind of device. :func:`weighted_cuts` solves the general problem the planner
needs: stage ``s`` runs at relative speed ``speeds[s]`` (its time is its cost / speed) and may be
refused by ``fits(s, begin, end)`` (the chunks begin..end-1 do not fit its memory). It minimises
the largest stage *time* by bisection on that time, each step a greedy left-to-right packing, which
is exact for contiguous partitions with ordered capacities: a stage that takes as many chunks as
it can never hurts the stages after it. On equal speeds and no memory limit it finds the same
largest stage cost as ``balanced_cuts`` (``tests/api/test_planner_cuts.py``).

    >>> weighted_cuts([1, 1, 1, 1, 1, 1], 2, speeds=[2.0, 1.0])   # the fast device takes 4 of 6
    [4]
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.errors import PlanError
from autopar.planner.schedule_shapes import schedule_of

__all__ = ["weighted_cuts", "stage_time", "memory_fits"]


def stage_time(costs: Sequence[float], cuts: Sequence[int], speeds: Sequence[float] | None = None) -> float:
    """The largest stage time of ``cuts`` (cost / speed)."""
    bounds = [0, *cuts, len(costs)]
    speeds = speeds or [1.0] * (len(bounds) - 1)
    return max(sum(costs[bounds[i]:bounds[i + 1]]) / speeds[i] for i in range(len(bounds) - 1))


def weighted_cuts(costs: Sequence[float], num_stages: int, *, speeds: Sequence[float] | None = None,
                  fits: Callable[[int, int, int], bool] | None = None,
                  allowed: Sequence[int] | None = None) -> list[int]:
    """Stage start indices (one per stage after the first) minimising the largest cost / speed.

    ``allowed``: indices a stage may begin at (default every index after 0).
    """
    n = len(costs)
    speeds = list(speeds) if speeds is not None else [1.0] * num_stages
    if len(speeds) != num_stages or min(speeds) <= 0:
        raise PlanError(f"{len(speeds)} stage speeds given for {num_stages} stages", where="weighted_cuts",
                        fix="give one positive speed per stage")
    starts = sorted({a for a in (allowed if allowed is not None else range(1, n)) if 0 < a < n})
    if num_stages - 1 > len(starts):
        raise PlanError(f"the model splits into at most {len(starts) + 1} pipeline stages, not {num_stages}",
                        where="pipeline partitioning", fix=f"use at most {len(starts) + 1} stages")
    if num_stages == 1:
        if fits is not None and not fits(0, 0, n):
            raise PlanError("the model does not fit one stage's memory", where="pipeline partitioning",
                            fix="use more pipeline stages or less memory per stage")
        return []
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def pack(limit: float) -> list[int] | None:
        cuts, lo, pos = [], 0, 0  # pos: index into starts of the first start after lo
        for s in range(num_stages - 1):
            stop = len(starts) - (num_stages - s - 2)  # leave a start for each cut still needed after this one
            best, base, speed = None, prefix[lo], speeds[s]
            while pos < stop:
                end = starts[pos]
                if (prefix[end] - base) / speed > limit or (fits is not None and not fits(s, lo, end)):
                    break
                best, pos = end, pos + 1
            if best is None:
                return None
            cuts.append(best)
            lo = best
        last = num_stages - 1
        if (prefix[n] - prefix[lo]) / speeds[last] > limit or (fits is not None and not fits(last, lo, n)):
            return None
        return cuts

    low, high = 0.0, prefix[n] / min(speeds) * (1 + 1e-12) + 1e-300
    if pack(high) is None:
        raise PlanError(f"no split into {num_stages} stages fits every stage's memory",
                        where="pipeline partitioning", fix="use more stages, recomputation or ZeRO")
    for _ in range(100):
        mid = (low + high) / 2
        if pack(mid) is None:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return pack(high)


def memory_fits(c, profile, cluster):
    """fits(stage, begin, end) for :func:`weighted_cuts`: a linear memory model of candidate ``c``'s stages
    (:class:`~autopar.planner.cost_model.Candidate`) on ``cluster``, for memory-aware boundaries."""
    chunks = profile.chunks[c.tp]
    b = profile.global_batch // (c.dp * c.num_microbatches)
    schedule, counts = schedule_of(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
    per_elem = _state_bytes_per_element(c.zero_stage, c.dp * c.cp, profile.precision)  # (ZeRO over dp x cp)
    prefix_state, prefix_act, acc_s, acc_a = [0.0], [0.0], 0.0, 0.0
    for ch in chunks:
        acc_s += ch.param_numel * per_elem + ch.buffer_bytes
        acc_a += ch.saved[c.recompute] * b / c.cp  # (a rank's 1/cp of every sequence)
        prefix_state.append(acc_s)
        prefix_act.append(acc_a)

    owners = schedule.stage_to_rank  # per stage: the microbatches in flight on its rank, its share of the rank
    in_flight = [-(-counts[q] // c.num_virtual) for q in owners]
    capacity = [cluster.usable_bytes(q * c.tp) / c.num_virtual for q in owners]

    def fits(stage: int, lo: int, hi: int) -> bool:
        need = prefix_state[hi] - prefix_state[lo] + in_flight[stage] * (prefix_act[hi] - prefix_act[lo])
        return need <= capacity[stage]
    return fits


def _state_bytes_per_element(zero: int, dp: int, precision: str) -> float:
    p = 2 if precision == "bf16" else 4
    master = 4 if precision == "bf16" else 0
    if dp == 1 or zero == 0:
        return p + master + 4 + 8
    if zero == 1:
        return p + master + 4 + 8 / dp
    if zero == 2:
        return p + master + (4 + 8) / dp
    return (p + master + 4 + 8) / dp
