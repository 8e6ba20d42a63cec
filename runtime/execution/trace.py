"""Seeing a schedule run: every rank's events as a Chrome/Perfetto trace and a PNG timeline, and the bubble.

The executor records, per action, ``(action, start, end)`` plus the seconds it spent blocked on a
peer's transfer (``ActionEvent.wait_s``) and the step's start (``ActionEvent.origin``).
:func:`gather_events` collects them from every rank of the world and lines them up on one clock
(``time.perf_counter`` is the host's monotonic clock, shared by the ranks of one host).

- :func:`chrome_trace` / :func:`write_chrome_trace`: the JSON that ``chrome://tracing`` and
  https://ui.perfetto.dev open; one track per rank, one slice per action.
- :func:`plot_timeline`: a PNG, one row per rank (F blue, B green, W orange, waits blank; needs
  matplotlib). It draws a simulated run the same way (:func:`from_simulation`).
- :func:`measured_bubble`: each rank's idle share of the step: a rank is busy from its first
  action to its last except while blocked on a transfer; the step spans all ranks.
- :func:`replay`: the simulator run on the same schedule with each action's measured duration
  (its own time, less the transfer wait, plus the loop overhead since the previous action) and
  the step's shortest transfer latency (:func:`transfer_latency`), so the simulated bubble differs
  from the measured one only by slower transfers (and a process woken late) and the ranks' start
  skew.
  :func:`bubble_report` prints them side by side.
- :func:`measured_critical_path`: the run's own critical path, read after the fact: the step graph
  (:mod:`autopar.runtime.schedules.step_graph`) with each action's measured duration and the
  replay's transfer latency; its length is the replay's step time.

    >>> events = [[TraceEvent("0F0", 0.0, 1.0), TraceEvent("0B0", 2.0, 3.0, wait=0.5)],
    ...           [TraceEvent("1F0", 1.0, 2.0), TraceEvent("1B0", 2.0, 2.5)]]
    >>> [round(b, 3) for b in measured_bubble(events)]
    [0.167, 0.5]
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import NamedTuple

import torch.distributed as dist

from autopar.runtime.schedules.action import Action, Schedule
from autopar.runtime.schedules.simulator import SimResult, StageCosts, simulate
from autopar.runtime.schedules.step_graph import CriticalPath

__all__ = ["TraceEvent", "gather_events", "chrome_trace", "write_chrome_trace", "plot_timeline",
           "measured_bubble", "action_durations", "transfer_latency", "replay", "bubble_report",
           "from_simulation", "measured_critical_path"]

_KIND_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}
_ACTION = re.compile(r"^(\d+)([A-Z])(\d+)$")


class TraceEvent(NamedTuple):
    """One action on one rank: start and end in seconds from the step's start; ``wait`` of it blocked."""

    action: str
    start: float
    end: float
    wait: float = 0.0


def gather_events(program, *, group=None, events=None) -> list[list[TraceEvent]]:
    """Every rank's events of ``program``'s last step (or of ``events``, a step's ``program.events``
    kept earlier), on one clock starting at 0 (collective)."""
    recorded = program.events if events is None else events
    mine = [(str(e[0]), e.origin + e[1], e.origin + e[2], getattr(e, "wait_s", 0.0)) for e in recorded]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    zero = min((e[1] for rank in gathered for e in rank), default=0.0)
    return [[TraceEvent(a, s - zero, t - zero, w) for a, s, t, w in rank] for rank in gathered]


def from_simulation(result: SimResult) -> list[list[TraceEvent]]:
    """A simulated run's events as the executor records them: an action begins when the previous one
    ends and waits for its inputs inside (simulator time units instead of seconds)."""
    rows = []
    for row in result.events:
        previous, out = 0.0, []
        for e in row:
            out.append(TraceEvent(str(e.action), previous, e.end, wait=e.start - previous))
            previous = e.end
        rows.append(out)
    return rows


def _kind(action: str) -> str:
    match = _ACTION.match(action)
    return match.group(2) if match else action


def chrome_trace(events: Sequence[Sequence[TraceEvent]], *, name: str = "autopar pipeline") -> dict:
    """Chrome trace-event JSON (a dict): one thread track per rank, one complete slice per action."""
    out = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for rank, row in enumerate(events):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
        for e in row:
            out.append({"name": e.action, "cat": _kind(e.action), "ph": "X", "pid": 0, "tid": rank,
                        "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                        "args": {"waiting_on_peer_ms": round(e.wait * 1e3, 3)}})
            if e.wait > 0:  # drawn inside the action, at its start, where its receives block
                out.append({"name": "wait", "cat": "wait", "ph": "X", "pid": 0, "tid": rank,
                            "ts": e.start * 1e6, "dur": e.wait * 1e6})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, events: Sequence[Sequence[TraceEvent]], **kwargs) -> str:
    """Write :func:`chrome_trace` to ``path`` (open it in https://ui.perfetto.dev); returns the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events, **kwargs), f)
    return path


def plot_timeline(events: Sequence[Sequence[TraceEvent]], path: str, *, title: str = "", unit: str = "s",
                  width: float = 9.0, dpi: int = 80) -> str:
    """Draw one row per rank, one bar per action (F blue, B green, W orange), into a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(width, 0.45 * len(events) + 0.9), dpi=dpi)
    span = max((e.end for row in events for e in row), default=1.0) or 1.0
    for rank, row in enumerate(events):
        for e in row:  # the compute part only: the wait for a peer is left blank, it is bubble
            begin, color = e.start + e.wait, _KIND_COLORS.get(_kind(e.action), "#8C8C8C")
            ax.broken_barh([(begin, e.end - begin)], (rank - 0.4, 0.8), facecolors=color, edgecolors="white",
                           linewidth=0.5)
            match = _ACTION.match(e.action)
            if match and (e.end - begin) > span / 60:
                ax.text((begin + e.end) / 2, rank, match.group(3), ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(events)), [f"rank {r}" for r in range(len(events))])
    ax.set_ylim(len(events) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def measured_bubble(events: Sequence[Sequence[TraceEvent]]) -> tuple[float, ...]:
    """Per rank: ``1 - busy / step``; busy is first start to last end less transfer waits."""
    start = min((row[0].start for row in events if row), default=0.0)
    end = max((row[-1].end for row in events if row), default=0.0)
    step = end - start
    busy = [(row[-1].end - row[0].start - sum(e.wait for e in row)) if row else 0.0 for row in events]
    return tuple(1.0 - b / step if step > 0 else 0.0 for b in busy)


def action_durations(events: Sequence[Sequence[TraceEvent]]) -> dict[Action, float]:
    """Each action's own time: end minus the previous action's end (its start, for a rank's first), less waits."""
    durations = {}
    for row in events:
        previous = None
        for e in row:
            began = e.start if previous is None else previous
            durations[Action.parse(e.action)] = max(e.end - began - e.wait, 0.0)
            previous = e.end
    return durations


def transfer_latency(schedule: Schedule, events: Sequence[Sequence[TraceEvent]]) -> float:
    """What a cross-rank dependency adds in the replay: the least, over consumers that waited, of the time
    from the producer's end to the consumer's wait ending; 0 if that is negative.

    A producer sends before its action ends (a stage's send is its forward's last node, a gradient
    leaves when backward reaches the receive, and the executor's bookkeeping follows), so the data
    can arrive before the producer's recorded end and a sample can be negative: what the replay
    needs is latency less that tail, which is small. A negative sample is therefore evidence of a
    fast transfer, not noise; leaving it out would make the least *positive* sample the estimate, and
    on a busy host that is typically a transfer whose receiver was woken late (milliseconds, where
    the transfer took a tenth of one). The least, not a typical one: a longer sample also holds the
    time the waiting process took to be scheduled again, which says nothing about the transfer."""
    from autopar.runtime.schedules.deps import dependencies
    end = {Action.parse(e.action): (rank, e.end) for rank, row in enumerate(events) for e in row}
    samples = []
    for rank, row in enumerate(events):
        for e in row:
            for dep in dependencies(Action.parse(e.action), num_stages=schedule.num_stages,
                                    num_replicas=schedule.num_replicas):
                if dep in end and end[dep][0] != rank and e.wait > 0:
                    samples.append(e.start + e.wait - end[dep][1])  # the wait ends when the data is in
    return max(min(samples, default=0.0), 0.0)


def replay(schedule: Schedule, events: Sequence[Sequence[TraceEvent]], *, p2p: float | None = None) -> SimResult:
    """Simulate ``schedule`` with every action's measured duration; transfers cost :func:`transfer_latency`."""
    p2p = transfer_latency(schedule, events) if p2p is None else p2p
    return simulate(schedule, costs=StageCosts(forward=0, backward=0, weight=0, p2p=p2p),
                    durations=action_durations(events))


def measured_critical_path(schedule: Schedule, events: Sequence[Sequence[TraceEvent]], *,
                           p2p: float | None = None) -> CriticalPath:
    """The critical path of a measured step: which actions and transfers made it as long as it was, each
    with its measured seconds (the :func:`replay`'s model, so its length is ``replay(...).step_time``)."""
    return replay(schedule, events, p2p=p2p).critical_path


def bubble_report(schedule: Schedule, events: Sequence[Sequence[TraceEvent]]) -> str:
    """Measured and simulated (replayed) bubble per rank, and the step's critical path, as a few lines of text."""
    measured = measured_bubble(events)
    replayed = replay(schedule, events)
    simulated = replayed.bubble_fraction
    lines = [f"{schedule.name}: bubble measured vs simulated with the measured action times"]
    for rank, (m, s) in enumerate(zip(measured, simulated)):
        lines.append(f"  rank {rank}: measured {m:6.1%}  simulated {s:6.1%}")
    lines.append(f"  mean  : measured {sum(measured) / len(measured):6.1%}  "
                 f"simulated {sum(simulated) / len(simulated):6.1%}")
    lines.append("  " + replayed.critical_path.summary(unit="s"))
    return "\n".join(lines)
