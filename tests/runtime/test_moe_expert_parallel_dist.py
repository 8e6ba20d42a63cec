"""Expert parallelism trains like one device (router aux loss included), holds 1/ep of the experts,
and moves tokens through the dispatch/combine all-to-alls the rewritten graph shows."""
from __future__ import annotations

import dataclasses
import functools
import json
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

from case_marks import by_world
from equivalence import Case, assert_equivalent, run_cases
import moe_runners

pytestmark = pytest.mark.dist

_EP = (("expert_parallel", 2), ("zero_stage", 0), ("num_microbatches", 1))
_HF = importlib.util.find_spec("transformers") is not None


CLIP = 0.05  # max_grad_norm: below every step's global gradient norm here, so clipping bites


def _case(model, dp, pp=1, zero=0, tp=1, clip=None, extra=()):
    # pp: GPipe with one microbatch, so the router statistics cover each rank's whole batch
    options = _EP[:1] + (("zero_stage", zero),) + _EP[2:] + ((("schedule", "gpipe"),) if pp > 1 else ()) \
        + ((("max_grad_norm", clip),) if clip is not None else ())
    return Case(model=model, mesh=(dp, pp, tp), kind="moe_runners:train", options=options, extra=extra)


# ZeRO-3: the experts over edp = dp / ep (whole at dp=2, where edp = 1), the rest over dp
ZERO3 = [_case("switch", 2, zero=3), _case("hf_mixtral", 2, zero=3), _case("switch", 4, zero=3),
         _case("hf_qwen3_moe", 4, zero=3)]
# max_grad_norm: the global norm counts every expert once (runtime/state/clip.py), clipping equal to one device's
CLIPPED = [_case("switch", 2, clip=CLIP), _case("deepseek", 2, zero=2, clip=CLIP), _case("switch", 4, clip=CLIP),
           _case("switch", 4, zero=1, clip=CLIP), _case("deepseek", 4, zero=3, clip=CLIP)]
# built on meta, each rank's pieces (its experts only) read from the CPU build's save_pretrained folder by
# compile(weights=autopar.hf.pretrained_weights(...)); equal to the CPU build trained on one device
_META = ((moe_runners.WEIGHTS, True), (moe_runners.SAVE, True))
META = [_case("hf_mixtral", 2, extra=_META), _case("hf_qwen3_moe", 2, tp=2, extra=_META)]
META_ZERO3 = _case("hf_mixtral", 4, zero=3, extra=_META[:1])  # each expert's ZeRO-3 block over edp read from the file
# and captured three blocks at a time (block_capture='once', the default of a large meta-built model): the
# experts of the repeated fourth block split too; no router loss (it reads every block: no template then)
ONCE = dataclasses.replace(_case("hf_mixtral", 2, extra=_META[:1]), options=_EP + (("block_capture", "once"),),
                           overrides=(("num_hidden_layers", 4), ("output_router_logits", False)))
# ep x pp under 1F1B with two microbatches a rank: routing is per token, so without the batch statistics
# of an aux loss (Mixtral's router logits off) any schedule and microbatch count equals one device
PIPED = dataclasses.replace(_case("hf_mixtral", 2, pp=2), overrides=(("output_router_logits", False),),
                            options=(("expert_parallel", 2), ("zero_stage", 0), ("num_microbatches", 2),
                                     ("schedule", "1f1b")))
_MODELS = ("hf_mixtral", "hf_qwen3_moe", "deepseek", "switch")
# every model on each mesh of the issue: dp=2 ep=2, dp=4 ep=2, dp=2 ep=2 x tp=2 (each ep rank's experts
# column/row-sharded over tp, passes/moe/tp_expert.py) and dp=2 ep=2 x pp=2; then ZeRO stages, clipping, meta
CASES = [*(_case(m, 2) for m in _MODELS), *(_case(m, 4) for m in _MODELS),
         *(_case(m, 2, tp=2) for m in _MODELS), *(_case(m, 2, pp=2) for m in _MODELS),
         _case("deepseek", 2, zero=1), _case("switch", 4, zero=2), *ZERO3, *CLIPPED, *META, META_ZERO3]
if not _HF:
    CASES = [c for c in CASES if not c.model.startswith("hf_")]
LAYERS = 2  # every model here has two MoE layers
# a capacity factor: 4.0 takes every row (ceil(4 * rows / 4 experts)), 0.5 drops some and counts them
CAPACITY = {cf: Case(model="switch", mesh=(2, 1, 1), kind="moe_runners:train",
                     options=_EP + (("moe_capacity_factor", cf),)) for cf in (4.0, 0.5)}
# bf16 with its experts split: ZeRO-1 steps the shared parameters' fp32 masters on their owners and the
# experts' masters (cut from the fp32 originals) on their edp owners (every holder at dp=2, where edp = 1),
# bitwise ZeRO-0's training; keyed by (dp, zero stage)
BF16 = {(dp, z): Case(model="switch", mesh=(dp, 1, 1), kind="moe_runners:train",
                      options=(("expert_parallel", 2), ("zero_stage", z), ("num_microbatches", 1),
                               ("precision", "bf16")))
        for dp in (2, 4) for z in (0, 1)}


# checkpoints of split experts: 2 steps saved on one mesh, step 3 resumed on another (both ways between
# dp=2 ep=2 x tp=2 and dp=4 ep=4 under ZeRO-1)
_EP_TP = ((2, 1, 2), _EP)
_EP4 = ((4, 1, 1), (("expert_parallel", 4), ("zero_stage", 1), ("num_microbatches", 1)))


def _ckpt_pair(name, saved_on, resumed_on):
    extra = (("name", name), ("save_after", 2))
    return (Case(model="deepseek", mesh=saved_on[0], kind="moe_runners:save", options=saved_on[1], extra=extra),
            Case(model="deepseek", mesh=resumed_on[0], kind="moe_runners:resume", options=resumed_on[1], extra=extra))


# and ZeRO-3 of the experts over edp (dp=4 ep=2: each rank one flat quarter of every expert tensor), both ways
_EP2Z3 = ((4, 1, 1), (("expert_parallel", 2), ("zero_stage", 3), ("num_microbatches", 1)))
# and ZeRO-1 at dp=4 ep=2: each expert's optimizer state saved by its one edp owner, resumed at dp=4 ep=4
_EP2Z1 = ((4, 1, 1), (("expert_parallel", 2), ("zero_stage", 1), ("num_microbatches", 1)))
CKPT = [_ckpt_pair("ep2-tp2-to-ep4", _EP_TP, _EP4), _ckpt_pair("ep4-to-ep2-tp2", _EP4, _EP_TP),
        _ckpt_pair("ep4-to-ep2-zero3", _EP4, _EP2Z3), _ckpt_pair("ep2-zero3-to-ep2-tp2", _EP2Z3, _EP_TP),
        _ckpt_pair("ep2-zero1-to-ep4", _EP2Z1, _EP4)]
# compile(plan="auto") on a cluster where replicated experts do not fit: the planner picks ep=2
AUTO = Case(model="switch", mesh=(2, 1, 1), kind="moe_runners:auto_train",
            options=(("zero_stage", 0), ("num_microbatches", 1), ("recompute", "none")))


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = [c for c in CASES + list(CAPACITY.values()) + list(BF16.values()) + [AUTO] + ([ONCE, PIPED] if _HF else [])
             + [c for pair in CKPT for c in pair] if c.world_size == world]
    root = tempfile.mkdtemp(prefix="autopar-moe-ckpt-")
    os.environ[moe_runners.CKPT_ENV] = root  # the spawned ranks inherit it
    for case in cases:
        if dict(case.extra).get(moe_runners.WEIGHTS):
            moe_runners.write_weights(case)
    try:
        return dict(zip(cases, run_cases(cases)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _reference(case: Case) -> dict:
    return moe_runners.reference(case)


@pytest.mark.parametrize("case", by_world(CASES, ids=Case.name))
def test_equal_to_one_device(case):
    assert_equivalent(case, _results(case.world_size)[case], _reference(case))


def _expert_elements(case) -> int:
    model = moe_runners.build(case)
    result = _results(case.world_size)[case]
    names = set(json.loads(result["plan"])["expert_params"])
    assert len(names) == 2 * LAYERS  # two 3-D expert tensors per layer
    return sum(p.numel() for n, p in model.named_parameters() if n in names)


@pytest.mark.parametrize("case", by_world(CASES, ids=Case.name))
def test_each_rank_holds_one_ep_th_of_the_experts(case):
    full = _expert_elements(case)
    _, pp, tp = case.mesh  # each pipeline stage holds its layers' experts, each tp rank a shard of every one
    share = full // 2 // pp // tp  # ep = 2
    zero, edp = dict(case.options)["zero_stage"], case.mesh[0] // 2
    if zero == 3 and edp > 1:
        share = _zero3_expert_shards(case)
    for rank in _results(case.world_size)[case]["rank_results"]:
        assert rank["expert_elements"] == share, "expert weights on this rank"
        if zero in (1, 2) and edp > 1:  # the momentum of its edp-owned expert tensors: test below
            continue
        assert rank["expert_state_elements"] == share, "SGD momentum of the experts on this rank"
    if tp > 1:  # 1/ep of the experts (dim 0), each one's MLP cut into 1/tp of its columns or rows
        _expert_shards_are_tp_cut(case, tp)


@pytest.mark.parametrize("case", by_world(CASES, ids=Case.name))
def test_ep_and_edp_groups_are_dims_of_the_one_mesh(case):
    """Each rank's ep and edp groups (the DeviceMesh's dp dim unflattened into edp x ep, no side groups) hold
    the ranks of the mesh laid out as (edp, ep, pp, tp): contiguous dp indices form an ep group."""
    dp, pp, tp = case.mesh
    grid = torch.arange(dp * pp * tp).reshape(dp // 2, 2, pp, tp)  # ep = 2
    for rank in _results(case.world_size)[case]["rank_results"]:
        e, k, p, t = (int(i) for i in (grid == rank["rank"]).nonzero()[0])
        assert rank["groups"] == {"ep": grid[e, :, p, t].tolist(), "edp": grid[:, k, p, t].tolist()}


_ZERO12_EDP = [c for c in CASES + list(BF16.values()) if dict(c.options)["zero_stage"] in (1, 2) and c.mesh[0] > 2]


@pytest.mark.parametrize("case", by_world(_ZERO12_EDP, ids=Case.name))
def test_zero12_keep_each_experts_state_on_one_edp_rank(case):
    """ZeRO-1/2 at dp=4 ep=2: each expert tensor's momentum lives on one of the dp/ep = 2 ranks holding that
    ep rank's experts (partitioned whole, greedy by size), so a rank holds 1/edp of its expert elements' state;
    the two edp ranks' shares add up to the ep rank's experts."""
    assert len(_ZERO12_EDP) >= 3  # switch under ZeRO-2 and ZeRO-1 (clipped), bf16 ZeRO-1
    result = _results(case.world_size)[case]
    assert "error" not in result, result.get("traceback")
    held = _expert_elements(case) // 2  # ep = 2: each rank's experts
    edp = case.mesh[0] // 2
    by_ep_rank: dict[int, list[int]] = {}
    for rank in result["rank_results"]:
        by_ep_rank.setdefault(rank["coords"]["tp"][1], []).append(rank["expert_state_elements"])
    for states in by_ep_rank.values():
        assert sum(states) == held and len(states) == edp
        assert all(s == held // edp for s in states), states  # its models' expert tensors are of one size
def _zero3_expert_shards(case) -> int:
    """ZeRO-3 at dp=4, ep=2: every rank stores each expert tensor as a flat block of 1/(ep * edp) = 1/4 of its
    elements (read off the shapes of the rank's stored shards); the elements of them all."""
    result = _results(case.world_size)[case]
    full = dict(moe_runners.build(case).named_parameters())
    ep, edp = 2, case.mesh[0] // 2
    for rank in result["rank_results"]:
        assert set(rank["expert_shapes"]) == set(json.loads(result["plan"])["expert_params"])
        for name, local in rank["expert_shapes"].items():
            assert local == [-(-full[name].numel() // (ep * edp))], (name, rank["coords"])
    return sum(-(-full[n].numel() // (ep * edp)) for n in rank["expert_shapes"])


@pytest.mark.parametrize("case", by_world(CLIPPED, ids=Case.name))
def test_clipping_counts_every_expert_once(case):
    """The global norm before clipping equals one device's every step, and bites (clipping is active)."""
    result, reference = _results(case.world_size)[case], _reference(case)
    assert "error" not in result, result.get("traceback")
    assert all(n > CLIP for n in reference["grad_norms"])
    for rank in result["rank_results"]:
        assert rank["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), rank["coords"]


def _expert_shards_are_tp_cut(case, tp: int) -> None:
    result = _results(case.world_size)[case]
    shards = json.loads(result["plan"])["param_shards"]
    full = dict(moe_runners.build(case).named_parameters())
    for rank in result["rank_results"]:
        assert set(rank["expert_shapes"]) == set(json.loads(result["plan"])["expert_params"])
        for name, local in rank["expert_shapes"].items():
            want = list(full[name].shape)
            want[0] //= 2
            assert shards[name]["dim"] in (1, 2), name  # a column or row cut, never the expert dim
            want[shards[name]["dim"]] //= tp
            assert local == want, (name, rank["coords"])


@pytest.mark.parametrize("case", by_world(CASES, ids=Case.name))
def test_all_to_all_per_layer(case):
    result = _results(case.world_size)[case]
    pp = case.mesh[1]
    for rank in result["rank_results"]:
        stage = rank["coords"]["pp"]
        # graph order, per layer; with tp, the experts' f after the dispatch and their g before the combine
        per_layer = ["MoeDispatch", "MoeCombine"] if case.mesh[2] == 1 else ["MoeDispatch", "TpCopy", "TpReduce",
                                                                             "MoeCombine"]
        assert rank["exchanges"] == {stage: per_layer * (LAYERS // pp)}
        # per layer: dispatch + combine in the forward, their conjugates in the backward
        assert rank["all_to_all"] == (2 * LAYERS // pp, 2 * LAYERS // pp)
        assert "moe_dispatch_" in rank["graph_code"][stage]  # visible when the graph is printed


def test_full_state_has_every_expert():
    case = CASES[0]
    state = _results(case.world_size)[case]["state"]
    model = moe_runners.build(case)
    for name, p in model.named_parameters():
        assert state[name].shape == p.shape


@pytest.mark.slow
@pytest.mark.skipif(not _HF, reason="transformers is not installed")
def test_save_pretrained_of_split_experts_reads_back_in_transformers():
    cases = [c for c in CASES if moe_runners.pretrained_round_trip(c)]
    # ep x tp (Mixtral, Qwen3-MoE), ZeRO-3 blocks over edp (Qwen3-MoE, meta-built Mixtral), the meta-built
    # cases that ask (Mixtral; Qwen3-MoE at tp=2)
    assert len(cases) == 6, [c.name() for c in cases]
    for case in cases:
        result = _results(case.world_size)[case]
        assert result["pretrained"] == [], case.name()  # rank 0: every weight as full_state_dict's


@pytest.mark.skipif(not _HF, reason="transformers is not installed")
@pytest.mark.parametrize("case", by_world(META, ids=Case.name))
def test_meta_built_model_from_weights_saves_a_folder_transformers_reads(case):
    # built on meta, loaded by compile(weights=...), trained 3 steps, saved
    result = _results(case.world_size)[case]
    assert "error" not in result, result.get("traceback")
    assert result["pretrained"] == []  # rank 0: from_pretrained gives every weight as full_state_dict's
    assert result["reloaded"] == []  # then load_pretrained of the original folder: every rank its experts' rows


@pytest.mark.skipif(not _HF, reason="transformers is not installed")
def test_blocks_captured_once_split_the_experts_of_every_block():
    result = _results(ONCE.world_size)[ONCE]
    assert_equivalent(ONCE, result, _reference(ONCE))
    assert any("3 blocks captured, 1 repeated" in m for m in result["block_template"]), result["block_template"]
    model = moe_runners.build(ONCE)
    experts = json.loads(result["plan"])["expert_params"]
    assert len(experts) == 2 * 4  # the repeated block's too
    full = sum(p.numel() for n, p in model.named_parameters() if n in experts)
    assert all(r["expert_elements"] * 2 == full for r in result["rank_results"])


@pytest.mark.parametrize("pair", by_world(CKPT, world_of=lambda pair: pair[0].world_size,
                                           ids=lambda pair: dict(pair[0].extra)["name"]))
def test_checkpoint_of_split_experts_resumes_on_another_ep_and_tp(pair):
    save, resume = pair
    saved, resumed = _results(4)[save], _results(4)[resume]
    assert "error" not in saved, saved.get("traceback")
    reference = _reference(save)
    assert resumed.get("step") == 2, resumed.get("traceback")
    # step 3 after the load: its loss and the weights after it as one device has them (momentum included)
    assert_equivalent(resume, resumed, {"losses": reference["losses"][2:], "state": reference["state"]})
    assert saved["losses"] == pytest.approx(reference["losses"][:2], rel=1e-5)


@pytest.mark.parametrize("pair", by_world(CKPT, world_of=lambda pair: pair[0].world_size,
                                           ids=lambda pair: dict(pair[0].extra)["name"]))
def test_load_full_state_dict_cuts_the_experts(pair):
    assert _results(4)[pair[1]]["full_state_round_trip"]


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


@pytest.mark.parametrize("case", by_world([c for c in CASES if not c.model.startswith("hf_")] + list(BF16.values()),
                                          ids=Case.name))
def test_model_states_match_the_calculator(case):
    """Every rank's measured parameters, masters, gradients and optimizer state equal the memory calculator's
    figures to the byte: the experts count 1/ep per rank, outside ZeRO's dp partition, and under ZeRO-1/2
    their state (ZeRO-2: gradients too) is partitioned over edp = dp / ep."""
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


@pytest.mark.parametrize("dp", [pytest.param(2), pytest.param(4, marks=pytest.mark.slow)])
def test_bf16_zero1_with_split_experts_equals_zero0(dp):
    zero1, zero0 = _results(dp)[BF16[(dp, 1)]], _results(dp)[BF16[(dp, 0)]]
    for result in (zero0, zero1):
        assert "error" not in result, result.get("traceback")
    assert zero1["losses"] == zero0["losses"]
    for key, value in zero0["state"].items():
        assert torch.equal(zero1["state"][key], value), key


def test_plan_auto_splits_the_experts_where_replicated_ones_do_not_fit():
    result = _results(AUTO.world_size)[AUTO]
    plan = json.loads(result["plan"])
    assert plan["expert_parallel"] == 2 and plan["mesh"]["dp"] == 2
    for rank in result["rank_results"]:  # the planner's own figures: split experts fit, replicated ones do not
        assert rank["needs"][1] < rank["needs"][0]
    assert_equivalent(AUTO, result, _reference(AUTO))
    full = sum(p.numel() for n, p in moe_runners.build(AUTO).named_parameters() if n in set(plan["expert_params"]))
    for rank in result["rank_results"]:
        assert rank["expert_elements"] == full // 2
        assert rank["all_to_all"] == (2 * LAYERS, 2 * LAYERS)


@pytest.mark.slow
@pytest.mark.skipif(not _HF, reason="transformers is not installed")
def test_experts_split_under_1f1b_with_microbatches():
    result = _results(PIPED.world_size)[PIPED]
    assert_equivalent(PIPED, result, _reference(PIPED))
    for rank in result["rank_results"]:  # each stage's layers: a dispatch and a combine per microbatch
        assert rank["all_to_all"] == (2 * 2 * LAYERS // 2, 2 * 2 * LAYERS // 2), rank["coords"]
