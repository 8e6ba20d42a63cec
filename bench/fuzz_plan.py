"""The plan fuzzer at nightly size: random (not derandomised) scenarios, many more than the default suite's 300.

    python bench/fuzz_plan.py                  # 3,000 examples, a fresh random seed (printed)
    python bench/fuzz_plan.py --examples 300 --seed 7

Each scenario (tests/plan_fuzz.py) either plans or gets an AutoparError with what/where/fix; a failure
prints hypothesis's falsifying example, to be fixed and kept as an @example in tests/api/test_fuzz_plan.py.
This is a test at a larger size, not a benchmark: it prints the outcome counts, no timings.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from plan_fuzz import cached_capture, check_scenario, scenarios  # noqa: E402

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    chosen = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {chosen}, {args.examples} examples")
    outcomes: collections.Counter = collections.Counter()

    @seed(chosen)
    @settings(max_examples=args.examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(scenario=scenarios())
    def fuzz(scenario):
        outcomes[check_scenario(scenario)] += 1

    with cached_capture():
        fuzz()
    print(dict(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
