"""The weight-version rules of the asynchronous schedules, as data: which weights each step reads.

An asynchronous pipeline never flushes: stage ``s`` updates its own weights while other
microbatches are still in flight, so a microbatch's forward and backward may read older
versions. *Version k* of a stage is its weights after its first ``k`` updates. A rule says, for
every (stage, microbatch) of the stream (microbatches numbered from the start of training):

- ``forward_version``: the version the forward reads;
- ``backward_version``: the version the backward reads (equal to the forward's when stashing);
- ``update_of``: which update the microbatch's gradient goes into (update ``k`` makes version ``k+1``).

With ``p`` stages and ``d_s = p - 1 - s`` (stage ``s``'s warmup forwards in 1F1B order, its
*delay*), the rules are:

========== =========================== ======================= =========================
schedule   forward version             backward version        update
========== =========================== ======================= =========================
pipedream  ``max(0, i - d_s)``         same (weight stashing)  every microbatch: ``i``
2bw        ``max(0, i // m - 1)``      same (two buffers)      every ``m``: ``i // m``
pipemare   ``max(0, i - d_s)``         ``i`` (the newest)      every microbatch: ``i``
========== =========================== ======================= =========================

PipeMare (no stashing) also rescales stage ``s``'s learning rate at update ``k`` by
``max(1, d_s) ** -(1 - min(k / K, 1))`` (``K = lr_warmup_updates``; the full rate once ``k >= K``),
and corrects the backward's weights toward the forward's: ``w_b = w - (v_b - v_f) * delta`` where
``delta`` is an exponential average (decay ``correction_decay``) of the stage's weight change per
update, ``delta <- decay * delta + (1 - decay) * (w_new - w_old)``.

    >>> rule = StalenessRule(kind="pipedream", num_stages=4)
    >>> [rule.forward_version(0, i) for i in range(6)]   # stage 0 lags 3 updates
    [0, 0, 0, 0, 1, 2]
    >>> StalenessRule(kind="2bw", num_stages=4, updates_every=4).forward_version(3, 9)  # batch 2 reads version 1
    1
"""
from __future__ import annotations

import dataclasses

from autopar.errors import ScheduleError

__all__ = ["StalenessRule", "STALENESS_KINDS"]

STALENESS_KINDS = ("pipedream", "2bw", "pipemare")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StalenessRule:
    """Which weight version each forward and backward of an asynchronous stream reads; see the module doc."""

    kind: str
    num_stages: int
    updates_every: int = 1
    lr_warmup_updates: int = 0
    correction_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ScheduleError(f"unknown staleness rule {self.kind!r}", fix=f"use one of {STALENESS_KINDS}")
        if self.kind != "2bw" and self.updates_every != 1:
            raise ScheduleError(f"{self.kind} updates after every microbatch, got updates_every={self.updates_every}")
        if self.num_stages < 1 or self.updates_every < 1 or self.lr_warmup_updates < 0:
            raise ScheduleError("num_stages and updates_every must be >= 1, lr_warmup_updates >= 0",
                                where=f"StalenessRule({self.kind})")
        if not 0.0 <= self.correction_decay < 1.0:
            raise ScheduleError(f"correction_decay must be in [0, 1), got {self.correction_decay}",
                                where=f"StalenessRule({self.kind})", fix="pass a decay such as 0.5")

    @property
    def stashes(self) -> bool:
        """Whether a backward reads the version its forward read (kept, "stashed", until then)."""
        return self.kind != "pipemare"

    def delay(self, stage: int) -> int:
        """Updates by which ``stage``'s forwards lag behind: its warmup forwards in 1F1B order."""
        return self.num_stages - 1 - stage

    def forward_version(self, stage: int, microbatch: int) -> int:
        if self.kind == "2bw":
            return max(0, microbatch // self.updates_every - 1)
        return max(0, microbatch - self.delay(stage))

    def backward_version(self, stage: int, microbatch: int) -> int:
        if self.kind == "pipemare":
            return microbatch
        return self.forward_version(stage, microbatch)

    def update_of(self, microbatch: int) -> int:
        """The update ``microbatch``'s gradient goes into."""
        return microbatch // self.updates_every

    def closes_update(self, microbatch: int) -> bool:
        """Whether the backward of ``microbatch`` is the last one of its update (the update runs after it)."""
        return (microbatch + 1) % self.updates_every == 0

    def lr_scale(self, stage: int, update: int) -> float:
        """PipeMare's learning-rate rescheduling factor for ``stage`` at ``update``; 1 for the others."""
        if self.kind != "pipemare" or self.lr_warmup_updates == 0:
            return 1.0
        progress = min(update / self.lr_warmup_updates, 1.0)
        return float(max(1, self.delay(stage))) ** -(1.0 - progress)
