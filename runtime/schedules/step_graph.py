"""One training step as a dependency graph (networkx): what waits for what, its longest path, its cycles.

Every action of every rank is a node. An edge ``u -> v`` says ``v`` cannot start before ``u``
ends: ``order`` when ``v`` follows ``u`` in its rank's list, ``data`` when ``v`` needs ``u``'s
output (:func:`~autopar.runtime.schedules.deps.dependencies`); a data edge between two ranks is a
transfer and carries its time (``transfer``). An edge weighs ``seconds(u) + transfer``, and every
rank's last action has an edge to the node :data:`END` weighing its own seconds, so

- the step time is the longest path's length (all ranks start at 0, each action starts when the
  last of its incoming edges is satisfied: the simulator's rule, evaluated here by networkx, there
  event by event; ``tests/runtime/test_step_graph.py`` holds them equal on many schedules);
- the **critical path** is that longest path: the actions and transfers that make the step as long
  as it is, each with the time it contributes (:func:`critical_path`);
- a schedule deadlocks exactly when the graph has a cycle, and the cycle is the deadlock
  (:func:`wait_cycle`; the validator prints it).

    >>> from autopar.runtime.schedules.one_f_one_b import one_f_one_b
    >>> from autopar.runtime.schedules.simulator import StageCosts
    >>> path = critical_path(one_f_one_b(num_ranks=2, num_microbatches=2),
    ...                      costs=StageCosts(forward=1, backward=1, weight=1, p2p=0.5))
    >>> path.length, " ".join(step.label for step in path.steps)
    (10.0, '0F0 0F0>1F0 1F0 1B0 1F1 1B1 1B1>0B1 0B1')
    >>> path.by_kind()
    {'F': 3.0, 'B': 6.0, 'transfer': 1.0}
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import networkx as nx

from autopar.runtime.schedules.action import Action, Schedule
from autopar.runtime.schedules.deps import dependencies

__all__ = ["END", "PathStep", "CriticalPath", "step_graph", "critical_path", "wait_cycle"]

END = "end"
"""The node every rank's last action leads to: a path's length to it is when that rank is done."""


def step_graph(schedule: Schedule, *, costs=None, durations: Mapping[Action, float] | None = None) -> nx.DiGraph:
    """The dependency graph of one step of ``schedule``.

    Node attributes: ``rank``, ``index`` (place in the rank's list), ``seconds`` (from ``costs``, a
    :class:`~autopar.runtime.schedules.simulator.StageCosts`, or ``durations`` per action; 0 with
    neither: the structure alone). Edge attributes: ``kinds`` (``{"order"}``, ``{"data"}`` or
    both), ``transfer`` (``costs.p2p`` on a data edge between ranks) and ``weight``. Asks nothing
    of the schedule's validity: a deadlocked schedule gives a graph with a cycle.
    """
    durations = durations or {}
    p2p = costs.p2p if costs is not None else 0.0
    graph = nx.DiGraph()
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            seconds = durations.get(action)
            if seconds is None:
                seconds = 0.0 if costs is None else costs.cost(action, num_stages=schedule.num_stages,
                                                                split_backward=schedule.split_backward)
            graph.add_node(action, rank=rank, index=index, seconds=float(seconds))
    for rank, row in enumerate(schedule.actions):
        for before, after in zip(row, row[1:]):
            graph.add_edge(before, after, kinds={"order"}, transfer=0.0)
    nodes = graph.nodes
    for action in list(nodes):
        for dep in dependencies(action, num_stages=schedule.num_stages, num_replicas=schedule.num_replicas):
            if dep not in nodes:
                continue  # a missing action: the validator's count check reports it
            crossing = nodes[dep]["rank"] != nodes[action]["rank"]
            if graph.has_edge(dep, action):
                graph.edges[dep, action]["kinds"].add("data")
            else:
                graph.add_edge(dep, action, kinds={"data"}, transfer=p2p if crossing else 0.0)
    for u, _v, data in graph.edges(data=True):
        data["weight"] = nodes[u]["seconds"] + data["transfer"]
    for row in schedule.actions:
        if row:
            graph.add_edge(row[-1], END, kinds={"order"}, transfer=0.0, weight=nodes[row[-1]]["seconds"])
    return graph


@dataclasses.dataclass(frozen=True)
class PathStep:
    """One piece of a critical path: an action (``kind`` F, B or W) or a transfer between ranks."""

    label: str  # "1F3", or "1F3>2F3" for the transfer from 1F3's rank to 2F3's
    kind: str  # "F", "B", "W" or "transfer"
    rank: int  # the rank that ran the action (a transfer: the receiving rank)
    start: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class CriticalPath:
    """The actions and transfers that make a step as long as it is, in order; their times sum to the step."""

    steps: tuple[PathStep, ...]

    @property
    def length(self) -> float:
        """The step time: when the path's last action ends."""
        return self.steps[-1].start + self.steps[-1].seconds if self.steps else 0.0

    @property
    def actions(self) -> tuple[str, ...]:
        """The path's actions (not its transfers), as printed: ``("0F0", "1F0", ...)``."""
        return tuple(s.label for s in self.steps if s.kind != "transfer")

    def by_kind(self) -> dict[str, float]:
        """Seconds the path spends in each kind (F, B, W, transfer), in that order, kinds it has only."""
        out: dict[str, float] = {}
        for kind in ("F", "B", "W", "transfer"):
            total = sum(s.seconds for s in self.steps if s.kind == kind)
            if any(s.kind == kind for s in self.steps):
                out[kind] = total
        return out

    def by_rank(self) -> dict[int, float]:
        """Seconds of the path's actions on each rank (transfers left out)."""
        out: dict[int, float] = {}
        for s in self.steps:
            if s.kind != "transfer":
                out[s.rank] = out.get(s.rank, 0.0) + s.seconds
        return dict(sorted(out.items()))

    def summary(self, *, unit: str = "", show: int = 8) -> str:
        """One line: the length, its split by kind, and the path (its first and last ``show`` actions)."""
        total = self.length or 1.0
        kinds = ", ".join(f"{k} {v:.4g} ({v / total:.0%})" for k, v in self.by_kind().items())
        names = self.actions
        shown = names if len(names) <= 2 * show else (*names[:show], f"... {len(names) - 2 * show} more ...",
                                                      *names[-show:])
        unit = f" {unit}" if unit else ""
        return f"critical path {self.length:.4g}{unit} = {kinds or 'nothing'}: {' '.join(shown)}"


def critical_path(schedule: Schedule, *, costs, durations: Mapping[Action, float] | None = None) -> CriticalPath:
    """The longest path through :func:`step_graph` (``schedule`` must be valid: no cycle)."""
    graph = step_graph(schedule, costs=costs, durations=durations)
    nodes = nx.dag_longest_path(graph, weight="weight")
    steps, clock = [], 0.0
    for u, v in zip(nodes, nodes[1:]):
        info, edge = graph.nodes[u], graph.edges[u, v]
        steps.append(PathStep(str(u), u.kind.value, info["rank"], clock, info["seconds"]))
        clock += info["seconds"]
        if edge["transfer"] > 0:
            steps.append(PathStep(f"{u}>{v}", "transfer", graph.nodes[v]["rank"], clock, edge["transfer"]))
            clock += edge["transfer"]
    return CriticalPath(tuple(steps))


def wait_cycle(schedule: Schedule) -> list[tuple[Action, Action, str]] | None:
    """A cycle of actions that wait for each other, as ``(action, what it waits for, why)`` with ``why``
    ``"order"`` (the rank runs it earlier) or ``"data"`` (its input); None when the step has no cycle."""
    graph = step_graph(schedule)
    try:
        edges = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return None
    waits = [(v, u, "data" if "data" in graph.edges[u, v]["kinds"] else "order") for u, v in reversed(edges)]
    start = min(range(len(waits)), key=lambda i: (graph.nodes[waits[i][0]]["rank"], graph.nodes[waits[i][0]]["index"]))
    return waits[start:] + waits[:start]

