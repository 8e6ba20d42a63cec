"""The GPU presets held to published large runs: estimate against measurement, and the planner's own choice.

For every row of autopar's table of published runs (autopar/planner/data/published_runs.json: Megatron-LM's
GPT 1.7B-1T on 32-3,072 A100s, its GPT-3 175B example, Megatron-Turing NLG 530B on 2,240-3,360 A100s), one
process, no GPU:

1. the run's model is profiled on the meta device at tp 1, 2, 4 and 8 (identical blocks captured once);
2. the run's own configuration (tp, pp, dp, microbatches, schedule, ZeRO stage, recomputation) is
   estimated, its pipeline simulated, on the preset of its GPUs (:mod:`autopar.planner.published_fit`),
   beside its measured step time (a published throughput turned into one: autopar/planner/published.py);
3. the planner chooses freely on the same GPUs and batch, and its estimate must be no slower than the
   run's configuration and fit in memory.

Reported: each row's error, the median and largest error of the rows the presets were fitted to and of
the held-out rows apart, and the planner's choice. ``--fit`` first fits the preset's figures to the rows
not held out (Levenberg-Marquardt, minutes: every fit row simulated ~10 times per iteration) and prints
them for autopar/planner/cluster.py; the table is then of the fitted figures.

    python bench/bench_published.py              # ~5-10 min on 2 cores; prints, updates docs/planner.md
    python bench/bench_published.py --rows mtnlg  # rows whose id contains a word; no docs update
    python bench/bench_published.py --fit --no-doc
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from _report import update_section

__all__ = ["rows_table", "section", "main"]

PLANNER_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "planner.md")


def _mesh(c) -> str:
    sched = c.schedule + (f" v={c.num_virtual}" if c.num_virtual > 1 else "")
    return f"{c.dp}x{c.pp}x{c.tp} m={c.num_microbatches} {sched} Z{c.zero_stage} {c.recompute}"


def rows_table(rows) -> str:
    """A markdown table: each run's measured and estimated step time, and the planner's choice."""
    head = ("run", "GPUs", "dp x pp x tp, microbatches, schedule, ZeRO, recompute", "measured s", "estimated s",
            "error", "set", "planner's choice", "its s", "vs run", "GiB (of)")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        c = r.choice
        choice = ("", "", "", "") if c is None else (
            _mesh(c.candidate), f"{c.step_time:.4g}", f"{(c.step_time / r.estimate.step_time - 1) * 100:+.0f}%",
            f"{c.memory / 2**30:.0f} ({c.capacity / 2**30:.0f})")
        lines.append("| " + " | ".join((
            f"`{r.run.id}`", str(r.run.gpus), _mesh(r.estimate.candidate), f"{r.run.step_seconds:.4g}",
            f"{r.estimate.step_time:.4g}", f"{r.error * 100:+.1f}%", "held out" if r.run.held_out else "fit",
            *choice)) + " |")
    return "\n".join(lines)


def section(rows, *, figures=None, seconds: float = 0.0) -> str:
    """The docs/planner.md section: the table and the error summary (fit and held-out rows apart)."""
    from autopar.planner.published_fit import summarize
    s = summarize(rows)
    slower = [r.run.id for r in rows if r.choice is not None and r.choice.step_time > r.estimate.step_time]
    unfit = [r.run.id for r in rows if r.choice is not None and not r.choice.fits]
    lines = [f"Run {time.strftime('%c')} (`python bench/bench_published.py`, {seconds:.0f} s, one process, "
             f"no GPU); 1-minute load average {os.getloadavg()[0]:.1f}.", ""]
    for name, label in (("fit", "rows the presets are fitted to"), ("held_out", "held-out rows"),
                        ("all", "all rows")):
        n, median, worst = s[name]
        lines.append(f"- {label} ({n}): median |error| {median:.1%}, largest {worst:.1%}")
    lines.append(f"- the planner's own choice no slower than the run's configuration on {len(rows) - len(slower)} of "
                 f"{len(rows)} rows" + (f" (slower: {', '.join(slower)})" if slower else "")
                 + (f"; does not fit: {', '.join(unfit)}" if unfit else "; every choice fits in memory"))
    if figures is not None:
        lines.append(f"- fitted figures: {figures}")
    return "\n".join(lines + ["", rows_table(rows)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help="only rows whose id contains one of these (no docs)")
    p.add_argument("--fit", action="store_true", help="fit the preset's figures to the rows not held out first")
    p.add_argument("--no-choice", action="store_true", help="skip the planner's free choice (faster)")
    p.add_argument("--no-doc", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("autopar.planner.search").setLevel(logging.WARNING)
    from autopar.planner.published import published_runs
    from autopar.planner.published_fit import PRESET_OF, Profiles, evaluate, fit
    from autopar.planner.cluster import get_cluster

    start = time.perf_counter()
    runs = [r for r in published_runs() if not args.rows or any(w in r.id for w in args.rows)]
    profiles, figures = Profiles(), None
    if args.fit:
        (gpu,) = {r.gpu for r in runs}  # one GPU kind per fit
        figures, history = fit([r for r in runs if not r.held_out], base=get_cluster(PRESET_OF[gpu]),
                               profiles=profiles)
        print(f"fitted {gpu}: {figures} (rms log error by iteration: {[round(h, 4) for h in history]})")
    rows = evaluate(runs, profiles=profiles, figures=figures, choose=not args.no_choice)
    text = section(rows, figures=figures, seconds=time.perf_counter() - start)
    print(text)
    if not args.no_doc and not args.rows and not args.fit:
        update_section("published_runs", text, path=PLANNER_DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
