"""Expert parallelism trains like one device (router aux loss included), holds 1/ep of the experts,
and moves tokens through the dispatch/combine all-to-alls the rewritten graph shows."""
from __future__ import annotations

import functools
import json
import importlib.util

import pytest
import torch

from equivalence import Case, assert_equivalent, run_cases
import moe_runners

pytestmark = pytest.mark.dist

_EP = (("expert_parallel", 2), ("zero_stage", 0), ("num_microbatches", 1))
_HF = importlib.util.find_spec("transformers") is not None


def _case(model, dp, pp=1, zero=0):
    # pp: GPipe with one microbatch, so the router statistics cover each rank's whole batch
    options = _EP[:1] + (("zero_stage", zero),) + _EP[2:] + ((("schedule", "gpipe"),) if pp > 1 else ())
    return Case(model=model, mesh=(dp, pp, 1), kind="moe_runners:train", options=options)


CASES = [_case("switch", 2), _case("hf_mixtral", 2), _case("hf_qwen3_moe", 4), _case("deepseek", 4),
         _case("hf_mixtral", 2, pp=2), _case("deepseek", 2, zero=1), _case("switch", 4, zero=2)]
if not _HF:
    CASES = [c for c in CASES if not c.model.startswith("hf_")]
LAYERS = 2  # every model here has two MoE layers
# a capacity factor: 4.0 takes every row (ceil(4 * rows / 4 experts)), 0.5 drops some and counts them
CAPACITY = {cf: Case(model="switch", mesh=(2, 1, 1), kind="moe_runners:train",
                     options=_EP + (("moe_capacity_factor", cf),)) for cf in (4.0, 0.5)}
# bf16 with its experts split: ZeRO-1 steps the shared parameters' fp32 masters on their owners and every
# holder steps its experts' masters itself (cut from the fp32 originals), bitwise ZeRO-0's training
BF16 = {z: Case(model="switch", mesh=(2, 1, 1), kind="moe_runners:train",
                options=(("expert_parallel", 2), ("zero_stage", z), ("num_microbatches", 1), ("precision", "bf16")))
        for z in (0, 1)}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = [c for c in CASES + list(CAPACITY.values()) + list(BF16.values()) if c.world_size == world]
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


def test_checkpoint_of_split_experts_is_refused():
    refused = _results(CASES[0].world_size)[CASES[0]]["checkpoint_refused"]
    assert refused.startswith("CheckpointError: save_checkpoint is not supported with expert_parallel=2")


def test_capacity_factor_that_takes_every_row_is_dropless():
    case = CAPACITY[4.0]
    result = _results(2)[case]
    assert_equivalent(case, result, _reference(case))
    assert all(r["dropped"][0] == 0 and r["dropped"][1] > 0 for r in result["rank_results"])


def test_capacity_factor_drops_and_counts():
    result = _results(2)[CAPACITY[0.5]]
    assert "error" not in result, result.get("traceback")
    # 3 steps x 2 layers x 64 rows (4 sequences of 16 tokens, top-1) per rank; each of the 4 experts takes
    # ceil(0.5 * 64 / 4) = 8 rows from each rank
    for rank in result["rank_results"]:
        dropped, seen = rank["dropped"]
        assert seen == 3 * LAYERS * 64
        assert seen - dropped <= 3 * LAYERS * 4 * 8 and dropped > 0
    assert all(torch.isfinite(torch.tensor(result["losses"])))


@pytest.mark.parametrize("case", [c for c in CASES if not c.model.startswith("hf_")] + list(BF16.values()),
                         ids=Case.name)
def test_model_states_match_the_calculator(case):
    """Every rank's measured parameters, masters, gradients and optimizer state equal the memory calculator's
    figures to the byte: the experts count 1/ep per rank and stay outside ZeRO's dp partition."""
    import autopar
    from autopar.memory import estimate_memory
    from autopar.models.moe import moe_loss
    result = _results(case.world_size)[case]
    assert "error" not in result, result.get("traceback")
    first = moe_runners.batches(case)[0]
    plan = autopar.plan(moe_runners.build(case), case.mesh, example_inputs=(first[0],), loss_fn=moe_loss,
                        example_target=first[1], **dict(case.options))
    predicted = estimate_memory(plan, optimizer="momentum")  # make_optimizer's SGD with momentum
    for rank, seen in enumerate(result["rank_results"]):
        want = predicted.ranks[rank]
        for field in ("params", "master_params", "grads", "optimizer"):
            assert getattr(seen["states"], field) == getattr(want, field), (rank, field)


def test_bf16_zero1_with_split_experts_equals_zero0():
    zero1, zero0 = _results(2)[BF16[1]], _results(2)[BF16[0]]
    for result in (zero0, zero1):
        assert "error" not in result, result.get("traceback")
    assert zero1["losses"] == zero0["losses"]
    for key, value in zero0["state"].items():
        assert torch.equal(zero1["state"][key], value), key
