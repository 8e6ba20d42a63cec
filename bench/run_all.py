"""Run every benchmark (autopar against its torch-native peer) and rewrite ``docs/benchmarks.md``.

    python bench/run_all.py            # about 3-4 minutes on 2 cores
    python bench/run_all.py --quick    # fewer rounds, for a smoke test (does not touch the docs)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_pipeline  # noqa: E402
import bench_tensor_parallel  # noqa: E402
from _report import DOC_PATH, console_table, fence, machine_line, today  # noqa: E402

__all__ = ["BENCHMARKS", "main", "header"]

#: (section name, module) of every benchmark, in document order.
BENCHMARKS = (("pipeline", bench_pipeline), ("tensor_parallel", bench_tensor_parallel))


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
        f"for {rounds} rounds of {steps_per_round} steps, the order flipped every round (A B, B A, ...), "
        "so slow drift in machine load hits both alike. Every step is bracketed by barriers, so a step "
        "time is the slowest rank's.",
        "- Reported: the median step time of each contender, **ratio = autopar median / peer median** "
        "(below 1 means autopar is faster), and the range of the per-round ratios (ratio of the two "
        "round medians, round by round) as a noise gauge. Absolute times drift 10-20% between runs "
        "and with other load on the machine; only the ratio measured in one run is meaningful.",
        "- Sanity: both contenders' losses are printed at step 1 and at their last step; equal "
        "values mean both really trained the same model on the same data.",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
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
        text = header(**timing) + "\n\n" + "\n\n".join(sections) + "\n"
        os.makedirs(os.path.dirname(DOC_PATH), exist_ok=True)
        with open(DOC_PATH, "w") as f:
            f.write(text)
        print(f"wrote {DOC_PATH}")
    return 0 if all_rows else 1


if __name__ == "__main__":
    sys.exit(main())
