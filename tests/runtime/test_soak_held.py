"""Long runs hold steady: what a program holds after step 20 is what it holds after step 60.

Every schedule family (synchronous, split backward, DualPipe and Chimera, each asynchronous one), DDP,
ZeRO-1/2/3, tp, ep and a run saving a checkpoint every 10 steps train 60 steps on every rank of a spawned
group (tests/shared_groups.py; the cases and their runner: tests/soak_runners.py). No clock: the census
is counted, not timed (runtime/diagnostics/memory_probe.py ``live_storages``):

- the storages of every live tensor the garbage collector finds, and their bytes, are the same after
  step 20 and step 60 on every rank: anything kept per step or per microbatch (a weight version, a send's
  buffer, an autograd graph, an event) would add at least 40 of them;
- the collector's other objects grow by fewer than one per step (a record kept per step, even one with no
  tensor in it, adds at least one; the count may move by one or two on its own);
- the program, once dropped, is collected with everything it holds.
"""
from __future__ import annotations

import pytest

from shared_groups import params, result
from soak_runners import SOAK_CASES, SOAK_CASES_FOUR

pytestmark = pytest.mark.dist

EARLY, LATE = 20, 60


@pytest.mark.parametrize("case", params(SOAK_CASES + SOAK_CASES_FOUR))
def test_a_long_run_holds_the_same_storages_at_step_20_and_60(case):
    outcome = result(case)
    assert "error" not in outcome, outcome.get("traceback", outcome.get("error"))
    assert set(outcome["ranks"]) == set(range(case.world_size))
    for rank, mine in outcome["ranks"].items():
        (early_count, early_bytes, early_objects) = mine["census"][EARLY]
        (late_count, late_bytes, late_objects) = mine["census"][LATE]
        where = f"{case.name()} rank {rank}"
        assert (late_count, late_bytes) == (early_count, early_bytes), (
            f"{where}: {late_count - early_count:+d} storages, {late_bytes - early_bytes:+d} bytes "
            f"from step {EARLY} to {LATE}")
        assert late_objects - early_objects < LATE - EARLY, (
            f"{where}: {late_objects - early_objects:+d} objects from step {EARLY} to {LATE}")
        assert mine["freed"], f"{where}: the dropped program is still alive"
