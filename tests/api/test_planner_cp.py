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
    assert two.parts["cp_comm"] == pytest.approx(hops) and without.parts["cp_comm"] == 0.0  # its own part
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
    assert plan.plan.cp_strategy == best.candidate.cp_strategy  # the Plan pins the strategy the cost model chose


def test_a_given_mesh_pins_cp():
    from autopar.plan_model import MeshShape
    from autopar.planner.auto import _pinned_degrees
    assert search_space({}, _pinned_degrees(MeshShape(dp=2), None)[1]).cp == (1,)  # (no cp dim: cp=1)
    assert search_space({}, _pinned_degrees(MeshShape(dp=1, cp=2), None)[1]).cp == (2,)
    assert search_space({}, _pinned_degrees(4, None)[1]).cp is None  # a world size: cp searched if need be
    assert dataclasses.replace(SearchSpace(), cp=None).cp is None


class _EagerAttention(torch.nn.Module):
    """A causal LM block that writes its attention by hand (matmul, scale, mask, softmax, matmul), 6 heads of 4."""

    def __init__(self, vocab: int = 32, dim: int = 24, heads: int = 6):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.embed(x)
        b, s, d = h.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, s, d))


def test_the_profile_records_eager_attention_for_both_strategies():
    torch.manual_seed(0)
    model, seq = _EagerAttention(), 16
    x = torch.randint(0, 32, (2, seq))
    profile = profile_model(model, example_inputs=(x,), loss_fn=lm_loss, example_target=x, tp_degrees=(1,))
    with_attention = [ch for ch in profile.chunks[1] if ch.attention_heads]
    assert len(with_attention) == 1, [(c.unit, c.attention_heads) for c in profile.chunks[1]]
    (chunk,) = with_attention
    per_tensor = 6 * seq * 4 * 4  # heads x positions x head dim x fp32 bytes, per sample
    assert (chunk.attention_heads, chunk.attention_kv, chunk.attention_qo) == (6, 2 * per_tensor, 2 * per_tensor)


def test_the_all_to_all_is_costed_as_four_exchanges_each_way(llama):
    from autopar.planner.chunk_time import cp_all_to_all, cp_comm, cp_ring
    _, _, profile = llama
    link = _cluster(80).intra
    chunk = next(ch for ch in profile.chunks[1] if ch.attention_kv)
    b, cp = 2, 4
    q, kv = chunk.attention_qo * b / cp / 2, chunk.attention_kv * b / cp / 2  # a rank's q (= its output), k (= v)
    one_way = 2 * link.all_to_all(q, cp) + 2 * link.all_to_all(kv, cp)
    assert cp_all_to_all(chunk, b=b, cp=cp, link=link) == pytest.approx((one_way, one_way))
    assert cp_comm(chunk, b=b, cp=cp, strategy="all_to_all", link=link) == cp_all_to_all(chunk, b=b, cp=cp, link=link)
    assert cp_comm(chunk, b=b, cp=cp, strategy="ring", link=link) == cp_ring(chunk, b=b, cp=cp, link=link)
    assert cp_all_to_all(chunk, b=b, cp=1, link=link) == (0.0, 0.0)


def test_the_candidates_offer_the_all_to_all_only_where_the_heads_divide(llama):
    from autopar.planner.candidates import cp_strategies
    _, _, profile = llama  # 4 query heads
    assert cp_strategies(1, 1, profile, SearchSpace()) == ("ring",)
    assert cp_strategies(2, 1, profile, SearchSpace()) == ("ring", "all_to_all")
    assert cp_strategies(4, 1, profile, SearchSpace()) == ("ring", "all_to_all")
    assert cp_strategies(8, 1, profile, SearchSpace()) == ("ring",)  # 4 heads do not split 8 ways
    assert cp_strategies(2, 1, profile, SearchSpace(cp_strategy="all_to_all")) == ("all_to_all",)
    assert search_space({"cp_strategy": "ring"}, {}).cp_strategy == "ring"


@pytest.mark.parametrize("latency_s, bandwidth, expected", [(1e-2, 1e12, "ring"), (1e-9, 1e6, "all_to_all")])
def test_the_planner_picks_the_strategy_that_costs_less(llama, latency_s, bandwidth, expected):
    """At cp=2 llama_tiny's ring moves a rank's K/V in 4 hops (1 forward, 3 backward), the all-to-all a quarter
    of the bytes in 8 exchanges: latency-bound links favour the ring, bandwidth-bound ones the all-to-all."""
    _, _, profile = llama
    base = _cluster(80)
    link = base.intra.model_copy(update={"latency_s": latency_s, "bandwidth": bandwidth})
    cluster = base.model_copy(update={"intra": link, "inter": link})
    space = SearchSpace(cp=(2,), dp=(1,), pp=(1,), tp=(1,), num_microbatches=(1,), zero_stages=(0,),
                        recompute=("none",))
    result = search(profile, cluster, world=2, space=space)
    times = {e.candidate.cp_strategy: e.step_time for e in result.ranked}
    assert set(times) == {"ring", "all_to_all"}, times
    assert result.best.candidate.cp_strategy == expected == min(times, key=times.get), times
