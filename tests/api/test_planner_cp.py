"""The planner and context parallelism: cp costed (a rank's 1/cp of each sequence, the ring's K/V, gradients and
ZeRO over dp x cp) and searched when no plan fits without it (autopar/planner/search.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss
from autopar.planner import get_cluster
from autopar.planner.auto import search_space
from autopar.planner.candidates import SearchSpace
from autopar.planner.cost_model import Candidate, CostModel
from autopar.planner.profile import profile_model
from autopar.planner.search import search

SEQ = 512


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = build_model("llama_tiny", seq_len=SEQ)
    x = torch.randint(0, model.cfg.vocab_size, (2, SEQ))
    profile = profile_model(model, example_inputs=(x,), loss_fn=lm_loss, example_target=x, tp_degrees=(1,))
    return model, x, profile


def _cluster(gib: float):
    base = get_cluster("a100-80g-8x")
    return base.model_copy(update={"device": base.device.model_copy(update={"memory_gb": gib}),
                                   "memory_reserve": 0.0}).for_world(2)


def test_the_profile_records_the_sequence_and_the_attention_kv(llama):
    _, _, profile = llama
    assert profile.seq_len == SEQ
    blocks = [ch for ch in profile.chunks[1] if ch.is_block]
    # llama_tiny: K and V as SDPA takes them (its 2 kv heads repeated to the 4 query heads of 8 features), fp32,
    # per sample of SEQ tokens: the profile's upper bound of what the ring passes (it passes the kv heads)
    assert blocks and all(ch.attention_kv == 2 * 4 * 8 * SEQ * 4 for ch in blocks), [c.attention_kv for c in blocks]


def test_cp_divides_activations_and_compute_and_adds_the_ring(llama):
    _, _, profile = llama
    model = CostModel(profile, _cluster(80))
    one, two = (model.estimate(Candidate(dp=1, pp=1, tp=1, num_microbatches=1, cp=cp), simulate_pipeline=True)
                for cp in (1, 2))
    assert two.memory_parts["activations"] == pytest.approx(one.memory_parts["activations"] / 2)
    assert two.parts["compute"] < one.parts["compute"]
    # the ring: per attention, a rank's K/V (2 rows, half of each sequence) one hop forward, three backward
    silent = dataclasses.replace(profile, chunks={1: [dataclasses.replace(ch, attention_kv=0.0)
                                                      for ch in profile.chunks[1]]})
    without = CostModel(silent, _cluster(80)).estimate(Candidate(dp=1, pp=1, tp=1, num_microbatches=1, cp=2),
                                                       simulate_pipeline=True)
    link = _cluster(80).intra
    hops = sum(4 * link.p2p(ch.attention_kv * 2 / 2) for ch in profile.chunks[1] if ch.attention_kv)
    assert hops > 0 and two.step_time - without.step_time == pytest.approx(hops)
    # ZeRO-3 over dp x cp: two ranks hold half the parameters each, as dp=2 does
    z3 = model.estimate(Candidate(dp=1, pp=1, tp=1, num_microbatches=1, cp=2, zero_stage=3), simulate_pipeline=True)
    dp2 = model.estimate(Candidate(dp=2, pp=1, tp=1, num_microbatches=1, zero_stage=3), simulate_pipeline=True)
    assert z3.memory_parts["params"] == dp2.memory_parts["params"] < one.memory_parts["params"]


def test_the_planner_picks_cp_when_nothing_fits_without_it(llama):
    model, x, profile = llama
    roomy = search(profile, _cluster(80), world=2, space=SearchSpace(cp=(1,)))
    least = min(e.memory for e in roomy.frontier.estimates.values())  # the frugalest plan without cp
    tight = _cluster(least * 0.97 / 2**30)
    result = search(profile, tight, world=2)
    best = result.best
    assert best.candidate.cp == 2 and best.fits, best.candidate.label()
    assert search(profile, tight, world=2, space=SearchSpace(cp=(1,))).ranked == []  # (cp=1 alone: nothing)
    # (tp=2 would fit too on this small model: pinned to the profile's tp=1, the plan takes cp)
    plan = autopar.plan(model, {"tp": 1, "world": 2}, plan="auto", cluster=tight, example_inputs=(x,),
                        loss_fn=lm_loss, example_target=x)
    assert plan.plan.mesh.cp == 2 and len(plan.ranks) == 2


def test_a_given_mesh_pins_cp():
    from autopar.plan_model import MeshShape
    from autopar.planner.auto import _pinned_degrees
    assert search_space({}, _pinned_degrees(MeshShape(dp=2), None)[1]).cp == (1,)  # (no cp dim: cp=1)
    assert search_space({}, _pinned_degrees(MeshShape(dp=1, cp=2), None)[1]).cp == (2,)
    assert search_space({}, _pinned_degrees(4, None)[1]).cp is None  # a world size: cp searched if need be
    assert dataclasses.replace(SearchSpace(), cp=None).cp is None
