"""passes/pipeline/partition.py: optimal cost-balanced cuts, only at block boundaries, explicit starts, errors."""
from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings, strategies as st

import autopar
from autopar.ir.meta_keys import MODULE, STAGE, get_meta
from autopar.models import lm_loss
from autopar.passes.frontend.annotate import annotate
from autopar.passes.frontend.capture import capture
from autopar.passes.pipeline.partition import balanced_cuts, cut_stages, pipeline_segments

from graph_runner import call_nodes, example_batch, planned, tiny_model

FOUR = (("num_layers", 4),)
_BLOCK = re.compile(r"^model\.(blocks|layers)\.\d+$")


# --- the dynamic program --------------------------------------------------------------------

def _stage_costs(costs, cuts):
    bounds = [0, *cuts, len(costs)]
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def _brute_force(costs, num_stages, allowed):
    """The least largest stage cost over every choice of num_stages-1 cuts from allowed (None if none)."""
    options = [a for a in sorted(set(allowed)) if 0 < a < len(costs)]
    best = None
    for cuts in itertools.combinations(options, num_stages - 1):
        worst = max(_stage_costs(costs, list(cuts)))
        best = worst if best is None else min(best, worst)
    return best


@st.composite
def _problems(draw):
    costs = draw(st.lists(st.integers(0, 50), min_size=1, max_size=9))
    allowed = sorted(draw(st.sets(st.integers(1, max(1, len(costs) - 1)), max_size=len(costs))))
    allowed = [a for a in allowed if a < len(costs)]
    num_stages = draw(st.integers(1, len(allowed) + 2))
    return costs, num_stages, allowed


@settings(max_examples=150, deadline=None)
@given(_problems())
def test_balanced_cuts_is_optimal_against_brute_force(problem):
    costs, num_stages, allowed = problem
    optimum = _brute_force(costs, num_stages, allowed)
    if optimum is None:
        with pytest.raises(autopar.PlanError, match=f"at most {len(allowed) + 1} pipeline stages"):
            balanced_cuts(costs, num_stages, allowed)
        return
    cuts = balanced_cuts(costs, num_stages, allowed)
    assert len(cuts) == num_stages - 1
    assert cuts == sorted(set(cuts)) and set(cuts) <= set(allowed)
    assert max(_stage_costs(costs, cuts)) == optimum


def test_balanced_cuts_on_a_hand_example():
    # an embedding, six equal blocks, a heavy head: the last stage takes the fewest blocks
    costs = [1, 10, 10, 10, 10, 10, 10, 35]
    cuts = balanced_cuts(costs, 2, allowed=[1, 2, 3, 4, 5, 6, 7])
    assert cuts == [6] and _stage_costs(costs, cuts) == [51, 45]  # 5 blocks, then 1 block + head


# --- on models ------------------------------------------------------------------------------

def _stage_units(result) -> list[list[str]]:
    """For each stage (tp rank 0), its call nodes' units in graph order."""
    stages = sorted((s for r in result.ranks.values() if r.coords["tp"] == 0 and r.coords["dp"] == 0
                     for s in r.stages), key=lambda s: s.stage)
    return [[get_meta(n, MODULE).unit for n in call_nodes(s.gm) if get_meta(n, MODULE)] for s in stages]


@pytest.mark.parametrize("name,pp", [("gpt_tiny", 2), ("gpt_tiny", 4), ("llama_tiny", 2)])
def test_stages_are_cut_only_at_block_boundaries(name, pp):
    model, _, _, result = planned(name, pp=pp, overrides=FOUR, batch=8)
    units = _stage_units(result)
    assert len(units) == pp
    owner: dict[str, int] = {}
    for stage, stage_units in enumerate(units):
        for unit in stage_units:
            if _BLOCK.match(unit):
                assert owner.setdefault(unit, stage) == stage, f"{unit} is split across stages"
    blocks = "blocks" if name == "gpt_tiny" else "layers"
    assert sorted(owner, key=lambda u: int(u.rsplit(".", 1)[1])) == [f"model.{blocks}.{i}" for i in range(4)]
    starts = result.plan.pipeline.stage_starts
    assert len(starts) == pp - 1
    for stage, start in enumerate(starts, start=1):  # each later stage begins with its named unit
        first = next(u for u in units[stage] if u)
        assert first == f"model.{start}"
        assert re.match(rf"^({blocks}\.\d+|ln_f|norm)$", start)


def _blocks_per_stage(result) -> list[int]:
    return [len({u for u in units if _BLOCK.match(u)}) for units in _stage_units(result)]


def test_a_heavy_lm_head_gets_fewer_blocks_on_the_last_stage():
    _, _, _, small = planned("gpt_tiny", pp=2, overrides=(("num_layers", 8),), batch=8)
    _, _, _, large = planned("gpt_tiny", pp=2, overrides=(("num_layers", 8), ("vocab_size", 4096)), batch=8)
    small_blocks, large_blocks = _blocks_per_stage(small), _blocks_per_stage(large)
    assert sum(small_blocks) == sum(large_blocks) == 8
    assert abs(small_blocks[0] - small_blocks[1]) <= 2  # a 128-word head weighs less than a block
    assert large_blocks[1] < small_blocks[1] and large_blocks[1] < large_blocks[0]


def test_cuts_minimise_the_largest_stage_cost_of_the_real_graph():
    gm, _ = _annotated_gpt(num_layers=6, vocab_size=1024)
    segments = pipeline_segments(gm)
    costs = [s.cost for s in segments]
    from autopar.passes.pipeline.partition import _allowed_starts
    allowed = _allowed_starts(segments)
    for num_stages in (2, 3, 4):
        cuts = balanced_cuts(costs, num_stages, allowed)
        assert max(_stage_costs(costs, cuts)) == _brute_force(costs, num_stages, allowed)


def _annotated_gpt(**overrides):
    model = tiny_model("gpt_tiny", tuple(sorted(overrides.items())))
    x, y = example_batch(model.cfg.vocab_size, batch=2)
    gm = capture(model, (x,), loss_fn=lm_loss, example_target=y).gm
    return annotate(gm, example_inputs=(x, y), model=model), model


@pytest.fixture(scope="module")
def gpt4():
    return _annotated_gpt(num_layers=4)


def test_explicit_stage_starts_are_honoured(gpt4):
    gm, _ = gpt4
    gm, starts = cut_stages(gm, num_stages=3, stage_starts=["model.blocks.1", "model.blocks.3"])
    assert starts == ["model.blocks.1", "model.blocks.3"]
    stage_of = {}
    for node in call_nodes(gm):
        stage_of.setdefault(get_meta(node, MODULE).unit, set()).add(get_meta(node, STAGE).stage)
    assert stage_of["model.tok_emb"] == stage_of["model.blocks.0"] == {0}
    assert stage_of["model.blocks.1"] == stage_of["model.blocks.2"] == {1}
    assert stage_of["model.blocks.3"] == stage_of["model.lm_head"] == {2}


def test_one_stage_puts_everything_on_stage_zero(gpt4):
    gm, _ = gpt4
    gm, starts = cut_stages(gm, num_stages=1)
    assert starts == [] and {get_meta(n, STAGE).stage for n in call_nodes(gm)} == {0}


@pytest.mark.parametrize("starts,message", [
    (["model.blocks.9"], r"\['blocks.9'\] are not places the model can be cut"),
    (["model.blocks.1.attn"], "are not places the model can be cut"),
    (["model.blocks.1", "model.blocks.2"], "names 2 stage starts for 2 stages"),
])
def test_bad_stage_starts_raise_plan_error(gpt4, starts, message):
    gm, _ = gpt4
    with pytest.raises(autopar.PlanError, match=message) as info:
        cut_stages(gm, num_stages=2, stage_starts=starts)
    assert info.value.where == "Plan.pipeline.stage_starts" and info.value.fix


def test_stage_starts_out_of_order_raise_plan_error(gpt4):
    gm, _ = gpt4
    with pytest.raises(autopar.PlanError, match="not in model order") as info:
        cut_stages(gm, num_stages=3, stage_starts=["model.blocks.3", "model.blocks.1"])
    assert "order the model runs them" in info.value.fix


def test_unknown_stage_start_lists_the_places_to_cut_as_the_plan_names_them(gpt4):
    gm, _ = gpt4
    with pytest.raises(autopar.PlanError) as info:
        cut_stages(gm, num_stages=2, stage_starts=["model.nowhere"])
    assert "'blocks.1'" in info.value.fix and "'ln_f'" in info.value.fix and "model." not in info.value.fix


def test_more_stages_than_places_to_cut_raise_plan_error(gpt4):
    gm, _ = gpt4  # 4 blocks: stages may begin at blocks.0..3 or ln_f, so at most 6 stages
    cut_stages(gm, num_stages=6)
    with pytest.raises(autopar.PlanError, match="at most 6 pipeline stages") as info:
        cut_stages(gm, num_stages=7)
    assert "pp" in info.value.where and "pp x num_virtual <= 6" in info.value.fix


def test_pp_larger_than_the_model_allows_raises_plan_error_from_plan():
    model = tiny_model("gpt_tiny")  # 2 blocks: at most 4 stages
    x, y = example_batch(model.cfg.vocab_size, batch=10)
    with pytest.raises(autopar.PlanError, match=r"at most 4 pipeline stages \(.*\), not 5"):
        autopar.plan(model, {"pp": 5}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, schedule="gpipe")
