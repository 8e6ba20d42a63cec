"""Stragglers: a rank whose actions compute markedly slower than its peers' on the same stages.

``program.events`` times every action of the step; with the flight record each event also knows
the seconds it spent blocked on peers (``wait_s``: pipeline receives, ``comm_s``: collectives),
so ``end - start - wait_s - comm_s`` is the rank's own compute. Ranks with the same pipeline
coordinate run the same stages (dp replicas, tp peers): the same work. A rank whose compute
is at least :data:`RATIO` times its peers' median and :data:`MIN_EXCESS_S` more (a slow node, a
throttled core, a process that slept) is a straggler.

No collective is added for it: each rank's figures (:data:`FIELDS`) ride in its own slots of the
world all-reduce the step already makes for the non-finite check and the loss
(:func:`autopar.runtime.execution.numerics.check_finite`'s ``riders``), so every rank sees every rank's
figures once per step. The lowest-ranked peer of a straggler logs one warning with the figures
and the wait it spent on it (the first time, then every :data:`REPEAT_EVERY` steps while it
lasts); every rank keeps the step's verdict in ``program.stragglers`` and a note in its flight record.

    >>> rows = [[0, 0.02, 0.03, 1.1, 0, 0.01], [0, 1.2, 0.03, 0.0, 1, 1.19]]
    >>> [s.rank for s in find_stragglers(rows, action_names=[["0F0", "0F1"]], step=3)]
    [1]
"""
from __future__ import annotations

import logging
import re
import statistics
from dataclasses import dataclass

import torch

__all__ = ["Straggler", "StragglerCheck", "find_stragglers", "action_compute", "RATIO", "MIN_EXCESS_S", "FIELDS"]

log = logging.getLogger(__name__)

RATIO = 1.5  # a straggler's compute is at least this many times its peers' median ...
MIN_EXCESS_S = 0.1  # ... and this many seconds more (below it, a busy host's noise)
REPEAT_EVERY = 50  # steps between two warnings about the same straggler
FIELDS = ("pp", "forward_s", "backward_s", "blocked_s", "slowest_action", "slowest_s")
_KIND = re.compile(r"^\d+([A-Z])\d+$")


@dataclass(frozen=True)
class Straggler:
    """One step's straggler and the figures that make it one."""

    rank: int
    pp: int
    step: int
    forward_s: float
    backward_s: float
    slowest_action: str
    slowest_s: float
    peers: tuple[int, ...]
    peer_compute_s: float  # the peers' median compute
    peer_blocked_s: float  # the most seconds a peer spent blocked on others this step

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def message(self) -> str:
        return (f"straggler at step {self.step}: rank {self.rank} (pipeline rank {self.pp}) computed its actions "
                f"in {self.compute_s:.3f} s (forward {self.forward_s:.3f} s, backward {self.backward_s:.3f} s; "
                f"slowest {self.slowest_action}: {self.slowest_s:.3f} s) against a median of "
                f"{self.peer_compute_s:.3f} s on rank{'s' if len(self.peers) > 1 else ''} "
                f"{', '.join(map(str, self.peers))}, which run the same stages and spent up to "
                f"{self.peer_blocked_s:.3f} s blocked on their peers")


def action_compute(event) -> float:
    """An action's own compute: its duration less the seconds it was blocked on transfers and collectives."""
    return max(event[2] - event[1] - getattr(event, "wait_s", 0.0) - getattr(event, "comm_s", 0.0), 0.0)


def find_stragglers(rows, *, action_names, step: int) -> list[Straggler]:
    """The stragglers among ``rows`` (one per global rank: :data:`FIELDS`); ``action_names[pp]``: the
    actions of pipeline rank ``pp`` in order (to name a straggler's slowest)."""
    by_pp: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        by_pp.setdefault(int(round(row[0])), []).append(rank)
    found = []
    for pp, ranks in sorted(by_pp.items()):
        for rank in ranks:
            peers = [r for r in ranks if r != rank]
            if not peers:
                continue
            mine = rows[rank][1] + rows[rank][2]
            median = statistics.median(rows[r][1] + rows[r][2] for r in peers)
            if mine >= RATIO * median and mine - median >= MIN_EXCESS_S:
                names = action_names[pp] if pp < len(action_names) else []
                index = int(round(rows[rank][4]))
                found.append(Straggler(rank, pp, step, rows[rank][1], rows[rank][2],
                                       names[index] if 0 <= index < len(names) else "?", rows[rank][5],
                                       tuple(peers), median, max(rows[r][3] for r in peers)))
    return found


class StragglerCheck:
    """This rank's part: its figures for the step's all-reduce, and the verdict on every rank's."""

    def __init__(self, *, rank: int, world: int, pp: int, action_names, flight, device):
        self.rank, self.world, self.pp, self.action_names = rank, world, pp, action_names
        self.flight, self.device = flight, device
        self.flagged: dict[int, int] = {}  # rank -> consecutive steps flagged
        self._comm_at_start = 0.0

    def begin(self) -> None:
        """The step starts: blocked time counts from here."""
        self._comm_at_start = self.flight.comm_wait_s
        self.flight.longest_wait = (0.0, -1)

    def riders(self, events) -> torch.Tensor:
        """World x :data:`FIELDS` values, zero but this rank's row (summed over the world, every rank's)."""
        forward = backward = 0.0
        slowest, slowest_s = 0, -1.0
        for i, e in enumerate(events):
            compute = action_compute(e)
            match = _KIND.match(e[0])
            if match and match.group(1) == "F":
                forward += compute
            else:
                backward += compute
            if compute > slowest_s:
                slowest, slowest_s = i, compute
        blocked = self.flight.comm_wait_s - self._comm_at_start + sum(getattr(e, "wait_s", 0.0) for e in events)
        rows = torch.zeros(self.world, len(FIELDS), dtype=torch.float32, device=self.device)
        rows[self.rank] = torch.tensor([self.pp, forward, backward, blocked, slowest, max(slowest_s, 0.0)],
                                       dtype=torch.float32, device=self.device)
        return rows.reshape(-1)

    def judge(self, summed: torch.Tensor, *, step: int) -> list[Straggler]:
        """The stragglers of the step from the summed riders; warns (module docstring)."""
        found = find_stragglers(summed.reshape(self.world, len(FIELDS)).tolist(), action_names=self.action_names,
                                step=step)
        flagged = {s.rank for s in found}
        self.flagged = {r: self.flagged.get(r, 0) + 1 for r in flagged}
        for s in found:
            self.flight.note("straggler", s.message())
            if self.rank == min(s.peers) and (self.flagged[s.rank] - 1) % REPEAT_EVERY == 0:
                log.warning("%s%s", s.message(), self._own_wait())
        return found

    def _own_wait(self) -> str:
        """This rank's longest wait of the step, in words."""
        seconds, index = self.flight.longest_wait
        latest = self.flight.latest(256)
        entry = next((e for e in latest if e.index == index), None)
        if entry is None:
            return ""
        action = next((e for e in reversed(latest) if e.kind == "action" and e.index < index), None)
        inside = action is not None and (action.is_open or action.end >= entry.start)
        during = f" during {action.name}" if inside else ""
        return f"; rank {self.rank}'s longest wait this step: {seconds:.3f} s in {entry.describe()}{during}"
