"""Stage boundaries for devices of any speed and memory (autopar/planner/stage_cuts.py)."""
from __future__ import annotations

import random

import pytest

from autopar.errors import PlanError
from autopar.passes.pipeline.partition import balanced_cuts
from autopar.planner.stage_cuts import stage_time, weighted_cuts


def test_equal_speeds_match_the_partitioners_balanced_cuts():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 30)
        costs = [rng.random() * 10 for _ in range(n)]
        k = rng.randint(1, min(n, 8))
        allowed = sorted(rng.sample(range(1, n), rng.randint(k - 1, n - 1)))
        ours = weighted_cuts(costs, k, allowed=allowed)
        theirs = balanced_cuts(costs, k, allowed) if k > 1 else []
        assert len(ours) == k - 1 and set(ours) <= set(allowed)
        assert stage_time(costs, ours) == pytest.approx(stage_time(costs, theirs), rel=1e-9)


def test_a_faster_device_gets_more_blocks():
    costs = [1.0] * 12
    assert weighted_cuts(costs, 2) == [6]
    assert weighted_cuts(costs, 2, speeds=[2.0, 1.0]) == [8]
    assert weighted_cuts(costs, 2, speeds=[1.0, 3.0]) == [3]
    cuts = weighted_cuts(costs, 3, speeds=[1.0, 2.0, 1.0])
    assert cuts == [3, 9]


def test_heavy_first_and_last_chunks_get_fewer_blocks():
    costs = [3.0] + [1.0] * 8 + [3.0]  # embedding, 8 blocks, head + loss
    cuts = weighted_cuts(costs, 4)
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(costs)])]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1]


def test_memory_limits_size_the_stages():
    costs = [1.0] * 10
    small_second = lambda stage, lo, hi: stage != 1 or hi - lo <= 2  # noqa: E731
    cuts = weighted_cuts(costs, 2, fits=small_second)
    assert cuts == [8]
    with pytest.raises(PlanError, match="fits every stage's memory"):
        weighted_cuts(costs, 2, fits=lambda stage, lo, hi: hi - lo <= 3)


def test_too_many_stages_and_bad_speeds_are_plan_errors():
    with pytest.raises(PlanError, match="at most 3 pipeline stages"):
        weighted_cuts([1.0] * 5, 4, allowed=[1, 2])
    with pytest.raises(PlanError, match="one positive speed per stage"):
        weighted_cuts([1.0] * 5, 2, speeds=[1.0])
