"""Expert parallelism trains like one device (router aux loss included), holds 1/ep of the experts,
and moves tokens through the dispatch/combine all-to-alls the rewritten graph shows."""
from __future__ import annotations

import functools
import json
import importlib.util

import pytest

from equivalence import Case, assert_equivalent, run_cases
import moe_runners

pytestmark = pytest.mark.dist

_EP = (("expert_parallel", 2), ("zero_stage", 0), ("num_microbatches", 1))
_HF = importlib.util.find_spec("transformers") is not None


def _case(model, dp, pp=1):
    # pp: GPipe with one microbatch, so the router statistics cover each rank's whole batch
    options = _EP + ((("schedule", "gpipe"),) if pp > 1 else ())
    return Case(model=model, mesh=(dp, pp, 1), kind="moe_runners:train", options=options)


CASES = [_case("switch", 2), _case("hf_mixtral", 2), _case("hf_qwen3_moe", 4), _case("deepseek", 4),
         _case("hf_mixtral", 2, pp=2)]
if not _HF:
    CASES = [c for c in CASES if not c.model.startswith("hf_")]
LAYERS = 2  # every model here has two MoE layers


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = [c for c in CASES if c.world_size == world]
    return dict(zip(cases, run_cases(cases)))


@functools.lru_cache(maxsize=None)
def _reference(case: Case) -> dict:
    return moe_runners.reference(case)


@pytest.mark.parametrize("case", CASES, ids=Case.name)
def test_equal_to_one_device(case):
    assert_equivalent(case, _results(case.world_size)[case], _reference(case))


def _expert_elements(case) -> int:
    model = moe_runners.build(case)
    result = _results(case.world_size)[case]
    names = set(json.loads(result["plan"])["expert_params"])
    assert len(names) == 2 * LAYERS  # two 3-D expert tensors per layer
    return sum(p.numel() for n, p in model.named_parameters() if n in names)


@pytest.mark.parametrize("case", CASES, ids=Case.name)
def test_each_rank_holds_one_ep_th_of_the_experts(case):
    full = _expert_elements(case)
    pp = case.mesh[1]  # each pipeline stage holds its layers' experts
    for rank in _results(case.world_size)[case]["rank_results"]:
        assert rank["expert_elements"] == full // 2 // pp, "expert weights on this rank"
        assert rank["expert_state_elements"] == full // 2 // pp, "SGD momentum of the experts on this rank"


@pytest.mark.parametrize("case", CASES, ids=Case.name)
def test_all_to_all_per_layer(case):
    result = _results(case.world_size)[case]
    pp = case.mesh[1]
    for rank in result["rank_results"]:
        stage = rank["coords"]["pp"]
        assert rank["exchanges"] == {stage: ["MoeDispatch", "MoeCombine"] * (LAYERS // pp)}  # graph order, per layer
        # per layer: dispatch + combine in the forward, their conjugates in the backward
        assert rank["all_to_all"] == (2 * LAYERS // pp, 2 * LAYERS // pp)
        assert "moe_dispatch_" in rank["graph_code"][stage]  # visible when the graph is printed


def test_full_state_has_every_expert():
    case = CASES[0]
    state = _results(case.world_size)[case]["state"]
    model = moe_runners.build(case)
    for name, p in model.named_parameters():
        assert state[name].shape == p.shape
