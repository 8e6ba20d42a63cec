"""The step graph (networkx) against the event-driven simulator and the validator's run, in one process.

Why the simulator keeps its own evaluation and the validator its own deadlock run
(docs/architecture.md, "Two libraries"): for each schedule the best of ``--repeats`` timings of

- the simulator's event-driven timing (``runtime/schedules/simulator.py`` ``_run``) against
  building the networkx step graph and taking its longest path (``step_graph.py``), and
- the validator's deadlock run (``validator.py`` ``_check_deadlock``) against a networkx cycle check
  of the same graph,

and their ratios. Both pairs answer the same question (a test holds them equal); only the ratio
means anything on a shared host.

    python bench/bench_step_graph.py                 # the table of docs/architecture.md (~1 min)
    python bench/bench_step_graph.py --repeats 1 --small
"""
from __future__ import annotations

import argparse
import time

import networkx as nx

from autopar.runtime.schedules import StageCosts, build_schedule
from autopar.runtime.schedules.simulator import _run
from autopar.runtime.schedules.step_graph import step_graph
from autopar.runtime.schedules.validator import _check_deadlock

__all__ = ["CASES", "main"]

CASES = [("1f1b", 4, 16), ("zb_v", 4, 16), ("zb_h1", 8, 64), ("interleaved_1f1b", 8, 64), ("zb_h1", 64, 64)]
COSTS = StageCosts(forward=1, backward=1.5, weight=0.7, p2p=0.1)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="the first two schedules only (a smoke run)")
    args = parser.parse_args(argv)
    print("| schedule (actions) | event-driven step | networkx longest path | validator's deadlock run | "
          "networkx cycle check |\n| --- | --- | --- | --- | --- |")
    for name, p, m in CASES[:2] if args.small else CASES:
        s = build_schedule(name, num_ranks=p, num_microbatches=m)
        event = _best(lambda: _run(s, COSTS, {}), args.repeats)
        graph = _best(lambda: nx.dag_longest_path_length(step_graph(s, costs=COSTS), weight="weight"), args.repeats)
        run = _best(lambda: _check_deadlock(s), args.repeats)
        cycle = _best(lambda: nx.is_directed_acyclic_graph(step_graph(s)), args.repeats)
        actions = sum(map(len, s.actions))
        print(f"| {name} p={p} m={m} ({actions:,}) | {event * 1e3:.3g} ms | {graph * 1e3:.3g} ms (x{graph / event:.1f}) "
              f"| {run * 1e3:.3g} ms | {cycle * 1e3:.3g} ms (x{cycle / run:.1f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
