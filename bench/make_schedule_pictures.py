"""Draw every schedule's simulated timeline into docs/img/ and write its figures into docs/schedules.md.

    python bench/make_schedule_pictures.py            # ~10 s; rewrites docs/img/schedule_*.png and the table
    python bench/make_schedule_pictures.py --closed-forms   # only the registry's formulas table

Setting: p = 4 ranks, m = 8 microbatches (the asynchronous ones: a stream of 3 batches of 8), a
rank's whole share of the model costs F = 1 forward, B = 1 input-gradient backward and W = 1
weight-gradient backward (a schedule that does not split backward runs B + W = 2 at once), and
transfers are free. A schedule with v stages per rank (and per replica) cuts that share v ways.
"""
from __future__ import annotations

import os
import re
import sys

from autopar.runtime.schedules import StageCosts, build_schedule, simulate
from autopar.runtime.schedules.asynchronous import pipedream, pipedream_2bw, pipemare
from autopar.runtime.schedules.registry import closed_forms_table, default_stages_per_rank, schedule_names
from autopar.runtime.execution.trace import from_simulation, plot_timeline

__all__ = ["SCHEDULES", "figures", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.path.join(ROOT, "docs", "img")
DOC = os.path.join(ROOT, "docs", "schedules.md")
P, M, BATCHES = 4, 8, 3
ASYNC = {"pipedream": pipedream, "pipedream_2bw": pipedream_2bw, "pipemare": pipemare}
#: name -> stages per rank within one replica (the cost of a stage is 1 / that)
SCHEDULES = {name: default_stages_per_rank(name) for name in schedule_names()}  # the registry's


def _schedule(name: str):
    if name in ASYNC:
        return ASYNC[name](num_ranks=P, num_microbatches=M, num_batches=BATCHES)
    virtual = SCHEDULES[name] if name in ("interleaved_1f1b", "looped_bfs") else None
    return build_schedule(name, num_ranks=P, num_microbatches=M, num_virtual=virtual)


def figures(name: str):
    """(schedule, simulation) of ``name`` in the setting of the module doc."""
    schedule = _schedule(name)
    v = SCHEDULES[name]
    return schedule, simulate(schedule, costs=StageCosts(forward=1 / v, backward=1 / v, weight=1 / v))


def _row(name: str, schedule, result) -> str:
    v = SCHEDULES[name]
    peak = max(result.peak_activations) / v  # in units of one rank's whole share of one microbatch
    weights = f"{schedule.num_replicas} replicas" if schedule.num_replicas > 1 else "1"
    if result.weight_versions > 1:
        weights = f"up to {result.weight_versions} versions"
    bubble = f"{result.mean_bubble:.1%}"
    if name in ASYNC:
        bubble += f" over {BATCHES} batches (one fill and drain)"
    return (f"| `{name}` | {bubble} | {result.steady_bubble:.1%} | {peak:g} | {weights} | "
            f"{result.step_time:g} |")


def table(rows: list[str]) -> str:
    header = ("| schedule | bubble (synchronous step) | bubble, steps back to back | peak activations, rank 0 "
              "(microbatches) | weights per rank | step time (F units) |\n|---|---|---|---|---|---|")
    return header + "\n" + "\n".join(rows)


def _replace_block(marker: str, body: str) -> None:
    """Rewrite docs/schedules.md between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    text = open(DOC).read()
    new, count = re.subn(f"<!-- {marker} -->.*?<!-- /{marker} -->", lambda _m: f"<!-- {marker} -->\n{body}\n"
                         f"<!-- /{marker} -->", text, flags=re.S)
    if count:
        with open(DOC, "w") as f:
            f.write(new)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _replace_block("closed-forms", closed_forms_table())  # the registry's formulas (tests compare the page)
    if "--closed-forms" in argv:
        return 0
    os.makedirs(IMG, exist_ok=True)
    rows = []
    for name in SCHEDULES:
        schedule, result = figures(name)
        path = os.path.join(IMG, f"schedule_{name}.png")
        plot_timeline(from_simulation(result), path, title=f"{name}: p={P}, m={M}"
                      + (f" x {BATCHES} batches" if name in ASYNC else ""), unit="F", width=8.0, dpi=60)
        rows.append(_row(name, schedule, result))
        print(rows[-1])
    _replace_block("figures", table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
