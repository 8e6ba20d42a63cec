"""The plan fuzzer (tests/plan_fuzz.py): every scenario plans, or gets autopar's error with what/where/fix.

300 derandomised examples run in the default suite; ``python bench/fuzz_plan.py`` runs a larger random
set (the nightly size). Every failure the fuzzer found is kept below as an @example.
"""
from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, example, given, settings

from plan_fuzz import Scenario, cached_capture, check_scenario, scenarios

OUTCOMES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _capture_cache():
    with cached_capture():
        yield
    # the property must not be vacuous: both kinds of outcome occur in the run
    assert OUTCOMES["planned"] >= 20 and OUTCOMES["refused"] >= 20, OUTCOMES


@settings(max_examples=300, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(scenario=scenarios())
# found by the fuzzer: build_schedule's ScheduleError for num_virtual on a fixed-stage schedule had no `where`
@example(scenario=Scenario(model="mlp", mesh=(1, 1, 1), batch=1, seq=16, options=(
    ("capture", "symbolic_trace"), ("num_virtual", 2), ("recompute", "selective"), ("tensor_parallel", False))))
def test_every_scenario_plans_or_gets_an_autopar_error(scenario: Scenario):
    OUTCOMES[check_scenario(scenario)] += 1
