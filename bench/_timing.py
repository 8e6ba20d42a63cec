"""Interleaved step timing of two contenders inside one process group, and the ratio of their medians.

Absolute step times on a shared 2-core machine drift by 10-20% between runs (far more when other
jobs share the cores), so a benchmark only ever reports a ratio measured in one run: the
contenders alternate in short rounds (A B, then B A, ...) so drift hits both alike, the first
``warmup`` steps of each are discarded, and each step is bracketed by barriers so its wall time
is the slowest rank's. Each step's CPU time (``time.process_time``, all threads, summed over the
ranks) is recorded too: it ignores time spent descheduled by other jobs, so its ratio is the
steadier gauge of per-step overhead, while the wall ratio also counts pipeline bubbles and waits.

Each contender's ``step(i)`` trains on batch ``i`` of a shared, fixed batch list (``i`` counts
that contender's own steps), so both see the same data in the same order and their losses
can be compared step by step.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["DEFAULTS", "Contender", "Timing", "measure", "ratio_summary", "row_cells", "cuda_synced"]

#: Default rounds / steps per round / warmup steps: short rounds pair the contenders' steps closely.
DEFAULTS = dict(rounds=16, steps_per_round=1, warmup=3)


@dataclass
class Contender:
    """A name and a ``step(i) -> loss`` callable that runs one training step on every rank."""

    name: str
    step: Callable[[int], float]
    losses: list[float] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)  # timed wall s, one list per round
    cpu_times: list[float] = field(default_factory=list)  # timed CPU s (all ranks), flat

    def run(self) -> tuple[float, float]:
        """One barrier-bracketed step; returns (wall seconds, CPU seconds summed over the ranks)."""
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = self.step(len(self.losses))
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(cpu)
        self.losses.append(float(loss))
        return wall, float(cpu)

    def run_round(self, steps: int) -> None:
        """``steps`` timed steps, kept as one round."""
        walls = []
        for _ in range(steps):
            wall, cpu = self.run()
            walls.append(wall)
            self.cpu_times.append(cpu)
        self.times.append(walls)


@dataclass(frozen=True)
class Timing:
    """Median step time (wall and CPU) of one contender and its per-round wall medians."""

    name: str
    median_s: float
    cpu_median_s: float
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
            c.run_round(steps_per_round)
    timings = []
    for c in contenders:
        flat = [t for rnd in c.times for t in rnd]
        timings.append(Timing(c.name, statistics.median(flat), statistics.median(c.cpu_times),
                              tuple(statistics.median(rnd) for rnd in c.times), len(flat),
                              c.losses[0], c.losses[-1]))
    return timings


def ratio_summary(mine: Timing, peer: Timing) -> dict:
    """Ratios of medians (mine / peer; < 1 means mine is faster): wall, CPU, and the quartiles of
    the per-round wall ratios (the spread a reader should trust the wall ratio to)."""
    per_round = sorted(a / b for a, b in zip(mine.round_medians_s, peer.round_medians_s))
    q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
    return {
        "ratio": mine.median_s / peer.median_s,
        "cpu_ratio": mine.cpu_median_s / peer.cpu_median_s,
        "round_q1": q1,
        "round_q3": q3,
    }


def row_cells(mine: Timing, peer: Timing) -> dict:
    """The timing and loss cells of a result row (see ``_report.COLUMNS``)."""
    r = ratio_summary(mine, peer)
    return dict(
        autopar=mine.name, peer=peer.name, autopar_s=mine.median_s, peer_s=peer.median_s,
        ratio=r["ratio"], round_iqr=f"{r['round_q1']:.2f}-{r['round_q3']:.2f}",
        cpu=f"{mine.cpu_median_s:.3f} / {peer.cpu_median_s:.3f}", cpu_ratio=r["cpu_ratio"],
        loss1=f"{mine.first_loss:.5f} / {peer.first_loss:.5f}",
        loss_last=f"{mine.last_loss:.5f} / {peer.last_loss:.5f}", steps=mine.num_steps,
    )


def cuda_synced(step):
    """``step`` followed by a CUDA synchronize, so that a timed step ends when the device's work does."""
    def run(i: int) -> float:
        loss = step(i)
        torch.cuda.synchronize()
        return loss
    return run
