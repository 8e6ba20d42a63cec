"""The planner in running jobs: ``compile(plan="auto")`` and dynamic re-balancing, judged against one device.

One spawned group of 2 gloo ranks runs every case (start-up costs seconds):

- a GPT whose pipeline is deliberately mis-split (``blocks.1``: one block on the first stage, three
  and the head on the second) is re-split during training; the proposal must be the split autopar
  balances by cost, the weights and the SGD momentum move with their stages, and the losses and
  final weights equal single-device training;
- every rank calibrates at once (compute, collectives, the switch time of ranks blocking on each other);
- ``compile(model, None, plan="auto")`` (the planner picks the degrees, the schedule, ZeRO and
  recomputation, and builds the mesh) trains exactly like one device.
"""
from __future__ import annotations

import pytest

import autopar
from autopar.models import build_model, lm_loss
from equivalence import Case, assert_equivalent, batches, reference_run, run_cases

pytestmark = pytest.mark.dist

REBALANCE = Case(model="gpt_tiny", mesh=(1, 2, 1), steps=6, overrides=(("num_layers", 6), ("hidden", 128)),
                 kind="planner_runners:rebalance_run",
                 extra=(("bad_starts", ("blocks.1",)), ("switch_at", 4), ("m", 2)))
CALIBRATION = Case(model="gpt_tiny", mesh=(2, 1, 1), steps=1, kind="planner_runners:calibration_run")
CASES = [
    REBALANCE,
    CALIBRATION,
    Case(model="llama_tiny", mesh=(2, 1, 1), steps=3, kind="planner_runners:auto_run", extra=(("no_mesh", True),)),
]


@pytest.fixture(scope="module")
def results():
    return dict(zip(CASES, run_cases(CASES, timeout_s=600)))


def _balanced_starts(case: Case) -> tuple[str, ...]:
    """What autopar's own cost-balanced partitioner chooses for the case's mesh."""
    import torch
    torch.manual_seed(0)
    model = build_model(case.model, seq_len=max(case.seq, 16), **dict(case.overrides))
    (idx, tgt), *_ = batches(case, model.cfg.vocab_size)
    result = autopar.plan(model, case.mesh, example_inputs=(idx,), loss_fn=lm_loss, example_target=tgt,
                          num_microbatches=dict(case.extra)["m"])
    return tuple(result.plan.pipeline.stage_starts)


# the balanced split worked out by hand, apart from any partitioner: six equal blocks (about 24 h^2 FLOPs
# per token each, h = 128), the embedding (a lookup) before them, the LM head (2 h V per token, V = 128:
# 1/12 of a block) and the loss after them. Three blocks on stage 0 and three plus the head on stage 1
# is the most even cut (3 against 3 1/12 blocks; the next, 4 against 2 1/12, is worse).
HAND_BALANCED = ("blocks.3",)


def test_rebalance_proposes_the_balanced_split_and_trains_like_one_device(results):
    result = results[REBALANCE]
    assert "error" not in result, result.get("traceback", result.get("error"))
    balanced = HAND_BALANCED
    assert _balanced_starts(REBALANCE) == balanced  # autopar's cost partitioner agrees with the hand count
    assert balanced != result["before"]
    assert result["proposal"] == balanced
    assert result["after"] == balanced
    assert result["step_count"] == REBALANCE.steps  # the step counter moved over too
    assert_equivalent(REBALANCE, result, reference_run(REBALANCE))


@pytest.mark.parametrize("case", CASES[2:], ids=lambda c: c.name())
def test_compile_with_plan_auto_trains_like_one_device(results, case):
    result = results[case]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert "est. s/step" in result["table"]
    assert_equivalent(case, result, reference_run(case))


@pytest.mark.timing  # a measured time bound: skipped by default (tests/conftest.py), run with -m timing
def test_calibrated_context_switch_is_under_50_ms(results):
    result = results[CALIBRATION]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert all(figures["switch_s"] < 0.05 for figures in result["figures"]), result["figures"]


def test_calibration_measures_every_figure_on_every_rank(results):
    result = results[CALIBRATION]
    assert "error" not in result, result.get("traceback", result.get("error"))
    for figures in result["figures"]:
        assert figures["switch_s"] >= 0
        assert all(figures[k] > 0 for k in ("matmul_flops", "memory_bandwidth", "allreduce_bandwidth", "p2p_bandwidth"))
    cluster = result["cluster"]
    import os
    if (os.cpu_count() or 1) >= 2:  # two ranks on two cores or more: no sharing to model
        assert cluster.cores_per_node is None and cluster.shared_core_switch_s == 0.0
