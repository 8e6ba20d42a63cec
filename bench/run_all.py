"""Run every benchmark (autopar against its torch-native peer) and rewrite ``docs/benchmarks.md``.

    python bench/run_all.py            # about 40 minutes on 2 cores (bench_planner.py runs apart)
    python bench/run_all.py --quick    # fewer rounds, for a smoke test (does not touch the docs)
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_data_parallel  # noqa: E402
import bench_pipeline  # noqa: E402
import bench_schedules  # noqa: E402
import bench_sequence_parallel  # noqa: E402
import bench_tensor_parallel  # noqa: E402
import bench_tp_gpt2  # noqa: E402
from _report import DOC_PATH, console_table, fence, machine_line, today  # noqa: E402
from _timing import DEFAULTS  # noqa: E402

__all__ = ["BENCHMARKS", "main", "header", "kept_sections"]

#: (section name, module) of every benchmark, in document order.
BENCHMARKS = (("pipeline", bench_pipeline), ("tensor_parallel", bench_tensor_parallel),
              ("tp_gpt2", bench_tp_gpt2), ("sequence_parallel", bench_sequence_parallel),
              ("schedules", bench_schedules),
              ("data_parallel", bench_data_parallel))


def header(*, rounds: int, steps_per_round: int, warmup: int) -> str:
    """Method and machine, the part of the document above the results."""
    return "\n".join([
        "# Benchmarks: autopar against its torch-native peers",
        "",
        f"Last full run: {today()} (`python bench/run_all.py`; each benchmark can also be run alone, "
        "e.g. `python bench/bench_pipeline.py`, which rewrites only its own section).",
        "",
        f"Machine: {machine_line()}.",
        "",
        "## Method",
        "",
        "- One run per benchmark: `bench/_spawn.py` starts 2 gloo ranks on 127.0.0.1 "
        "(`torch.set_num_threads(1)` each) and both contenders live in the same process group, "
        "built from the same seed, trained on the same character batches in the same order, "
        "with the same loss and optimizer.",
        f"- `bench/_timing.py` warms each contender up ({warmup} steps, discarded), then alternates them "
        f"for {rounds} rounds of {steps_per_round} step{'s' if steps_per_round != 1 else ''} each, the order flipped every round (A B, B A, ...), "
        "so slow drift in machine load hits both alike. Every step is bracketed by barriers, so a step "
        "time is the slowest rank's.",
        "- Reported: the median wall step time of each contender, **wall ratio = autopar median / peer "
        "median** (below 1 means autopar is faster), the quartiles of the per-round wall ratios as a "
        "noise gauge, and the median CPU seconds per step (`time.process_time`, all threads, summed over "
        "both ranks) with their ratio. The CPU ratio ignores time lost to other jobs on the cores, so it "
        "is the steadier gauge of per-step overhead; the wall ratio also counts pipeline bubbles and "
        "waits. Absolute times drift 10-20% between runs (more when other jobs share the 2 cores; the "
        "load average is recorded with each section); only ratios measured in one run mean anything.",
        "- Sanity: both contenders' losses are printed at step 1 and at their last step; equal "
        "values mean both really trained the same model on the same data. (A last loss above the "
        "first is not a bug: 4 batches cycled under AdamW lr 1e-3 without warmup spike at step 19 in "
        "single-device training too, 6.66 there.)",
    ])


def kept_sections(produced: set[str], *, path: str = DOC_PATH) -> list[str]:
    """Fenced sections of the current document that no benchmark writes (e.g. profiling notes)."""
    if not os.path.exists(path):
        return []
    text = open(path).read()
    found = re.findall(r"(<!-- bench:([\w.+-]+) -->.*?<!-- /bench:\2 -->)", text, re.S)
    return [block for block, name in found if name not in produced]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps; leaves the docs alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps_per_round, args.warmup = 2, 2, 2
    timing = dict(rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup)
    sections, all_rows = [], []
    for name, module in BENCHMARKS:
        print(f"== {name}", flush=True)
        rows = module.run(**timing)
        print(console_table(rows), flush=True)
        all_rows += rows
        sections.append(fence(name, module.section(rows)))
    if not args.quick:
        sections += kept_sections({name for name, _ in BENCHMARKS})
        text = header(**timing) + "\n\n" + "\n\n".join(sections) + "\n"
        os.makedirs(os.path.dirname(DOC_PATH), exist_ok=True)
        with open(DOC_PATH, "w") as f:
            f.write(text)
        print(f"wrote {DOC_PATH}")
    return 0 if all_rows else 1


if __name__ == "__main__":
    sys.exit(main())
