"""Interleaved step timing of two contenders inside one process group, and the ratio of their medians.

Absolute step times on a shared 2-core machine drift by 10-20% between runs, so a benchmark only
ever reports a ratio measured in one run: the contenders alternate in rounds (A B, then B A, ...)
so slow drift hits both alike, the first ``warmup`` steps of each are discarded, and each step
is bracketed by barriers so its time is the time of the slowest rank.

Each contender's ``step(i)`` trains on batch ``i`` of a shared, fixed batch list (``i`` counts
that contender's own steps), so both see the same data in the same order and their losses
can be compared step by step.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

__all__ = ["Contender", "Timing", "measure", "ratio_summary"]


@dataclass
class Contender:
    """A name and a ``step(i) -> loss`` callable that runs one training step on every rank."""

    name: str
    step: Callable[[int], float]
    losses: list[float] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)  # timed steps, one list per round

    def run(self) -> float:
        """One barrier-bracketed step; returns its wall time in seconds."""
        dist.barrier()
        t0 = time.perf_counter()
        loss = self.step(len(self.losses))
        dist.barrier()
        elapsed = time.perf_counter() - t0
        self.losses.append(float(loss))
        return elapsed


@dataclass(frozen=True)
class Timing:
    """Median step time of one contender and its per-round medians."""

    name: str
    median_s: float
    round_medians_s: tuple[float, ...]
    num_steps: int
    first_loss: float
    last_loss: float


def measure(contenders: list[Contender], *, rounds: int, steps_per_round: int,
            warmup: int) -> list[Timing]:
    """Warm each contender up, then alternate them for ``rounds`` rounds (order flipped each round)."""
    for c in contenders:
        for _ in range(warmup):
            c.run()
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            c.times.append([c.run() for _ in range(steps_per_round)])
    timings = []
    for c in contenders:
        flat = [t for rnd in c.times for t in rnd]
        timings.append(Timing(c.name, statistics.median(flat),
                              tuple(statistics.median(rnd) for rnd in c.times), len(flat),
                              c.losses[0], c.losses[-1]))
    return timings


def ratio_summary(mine: Timing, peer: Timing) -> dict:
    """Ratio of medians (mine / peer; < 1 means mine is faster) and the range of per-round ratios."""
    per_round = [a / b for a, b in zip(mine.round_medians_s, peer.round_medians_s)]
    return {
        "ratio": mine.median_s / peer.median_s,
        "round_ratio_min": min(per_round),
        "round_ratio_max": max(per_round),
    }
