"""Calibration's fits and the cost model's CPU terms: microbatch-size efficiency, ranks sharing cores.

Synthetic figures (nothing is judged by a timing; one tiny ``measure_model`` call checks its protocol);
``measure_switch`` runs in tests/api/test_planner_dist.py.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.models import build_model, lm_loss
from autopar.planner import Candidate, Cluster, CostModel, Device, Link, profile_model
from autopar.planner.calibrate import Calibration, calibrated_cluster, combine, fit_batch_efficiency
from autopar.planner.stage_cuts import weighted_cuts

LINK = Link(latency_s=1e-5, bandwidth=1e9)


@pytest.fixture(scope="module")
def profile():
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=4, seq_len=16)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
    return profile_model(model, example_inputs=(x,), loss_fn=lm_loss, example_target=y, tp_degrees=(1,))


def _device(**update) -> Device:
    return Device(name="core", flops={"fp32": 2e10}, efficiency=1.0, memory_gb=4, memory_bandwidth=1e10,
                  op_overhead_s=1e-5).model_copy(update=update)


def _cluster(ranks: int, **update) -> Cluster:
    return Cluster(name="cpu", devices_per_node=ranks, device=_device(), intra=LINK, inter=LINK,
                   memory_reserve=0.0).model_copy(update=update)


def test_fit_batch_efficiency_recovers_the_rates_behind_the_timings(profile):
    chunks = profile.chunks[1]
    ops, flops, written = (sum(getattr(c, k) for c in chunks) for k in ("ops", "flops", "bytes_written"))
    o, bw = 1e-5, 1e10
    rates = {1: 1e10, 4: 1.8e10, 16: 2e10, 32: 1.9e10}
    timings = {b: 3 * (ops * o + b * (flops / r + written / bw)) for b, r in rates.items()}
    table = dict(fit_batch_efficiency(profile, timings, memory_bandwidth=bw, op_overhead_s=o, reference=16))
    assert table == pytest.approx({b: r / rates[16] for b, r in rates.items()}, rel=1e-9)


def test_rate_factor_interpolates_and_small_microbatches_cost_more_per_sample(profile):
    device = _device(batch_efficiency=((1, 0.5), (4, 0.8), (16, 1.0)))
    assert device.rate_factor(2) == pytest.approx(0.65)
    assert device.rate_factor(64) == 1.0 and device.rate_factor(1) == 0.5
    flat = CostModel(profile, _cluster(1))
    measured = CostModel(profile, _cluster(1, device=device))
    c = Candidate(1, 1, 1, 8)  # 1 sample per microbatch
    assert measured.estimate(c).parts["compute"] > flat.estimate(c).parts["compute"]
    c = Candidate(1, 1, 1, 1)  # 8 samples: between 4 and 16
    assert measured.estimate(c).parts["compute"] > flat.estimate(c).parts["compute"]


def _estimate(model: CostModel, c: Candidate):
    c = replace(c, cuts=tuple(weighted_cuts(model.chunk_costs(c), c.num_stages)))
    return model.estimate(c, simulate_pipeline=True)


def test_shared_cores_lend_bubbles_and_charge_switches_per_action(profile):
    own = CostModel(profile, _cluster(4))
    shared = CostModel(profile, _cluster(4, cores_per_node=2))
    switching = CostModel(profile, _cluster(4, cores_per_node=2, shared_core_switch_s=2e-3))
    # dp=2 x pp=2 on 2 cores: each pipeline has one core, so nothing overlaps and every switch counts
    few, many = Candidate(2, 2, 1, 2, "1f1b"), Candidate(2, 2, 1, 4, "zb_v", num_virtual=2)
    for c in (few, many):
        alone, two = _estimate(own, c), _estimate(shared, c)
        assert two.step_time > alone.step_time  # half the cores
        assert two.parts["bubble"] <= alone.parts["bubble"]  # a waiting rank lends its core
    assert _estimate(own, few).parts["bubble"] > 0 == _estimate(shared, few).parts["bubble"]
    added = {c: _estimate(switching, c).step_time - _estimate(shared, c).step_time for c in (few, many)}
    assert added[few] == pytest.approx(2 * 4 * 2e-3)  # two ranks, F and B of two microbatches each
    assert added[many] == pytest.approx(2 * 24 * 2e-3)  # two ranks, F, B and W of 4 microbatches x 2 stages


def test_calibrated_cluster_turns_shared_figures_into_a_lone_rank_and_its_cores():
    cal = dict(matmul_flops=1e10, memory_bandwidth=5e9, op_overhead_s=2e-5, allreduce_latency_s=1e-4,
               allreduce_bandwidth=1e9, p2p_latency_s=1e-4, p2p_bandwidth=1e9, cores=2, switch_s=1.5e-3,
               batch_efficiency=((4, 0.9), (16, 1.0)))
    shared = calibrated_cluster(combine([cal] * 4, 4))
    assert shared.cores_per_node == 2 and shared.shared_core_switch_s == 1.5e-3
    assert shared.device.matmul_rate("fp32") == pytest.approx(2e10)  # each rank measured half a core
    assert shared.device.op_overhead_s == pytest.approx(1e-5)
    assert shared.device.batch_efficiency == ((4, 0.9), (16, 1.0))
    alone = calibrated_cluster(combine([cal] * 2, 2))
    assert alone.cores_per_node is None and alone.shared_core_switch_s == 0.0
    assert alone.device.matmul_rate("fp32") == pytest.approx(1e10)
    assert Calibration(**{**cal, "batch_efficiency": ()}).world_size == 1


def test_measure_model_syncs_before_each_size_and_times_for_at_least_min_seconds():
    from autopar.planner.calibrate import measure_model
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=1, seq_len=8, hidden=32, num_heads=2)
    x = torch.randint(0, 128, (4, 8))
    synced = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = measure_model(model, example_inputs=(x,), loss_fn=lm_loss, example_target=x, sizes=(1, 4), repeats=2,
                        optimizer=opt, sync=lambda: synced.append(1), min_seconds=0.05)
    assert set(out) == {1, 4, "optimizer"} and all(v > 0 for v in out.values())
    assert len(synced) == 3  # before each size and before the optimizer step


def test_split_backward_overhead_is_charged_to_every_split_stage_but_the_first(profile):
    plain = CostModel(profile, _cluster(2))
    split = CostModel(profile, _cluster(2, device=_device(split_backward_overhead=0.2)))
    c = Candidate(1, 2, 1, 4, "zb_v", num_virtual=2)
    c = replace(c, cuts=tuple(weighted_cuts(plain.chunk_costs(c), c.num_stages)))
    (_, b0, w0, _), (_, b1, w1, _) = plain.stage_times(c), split.stage_times(c)
    assert w1[0] == w0[0]  # the first stage runs its backward whole
    assert w1[1:] == pytest.approx([w + 0.2 * (b + w) for b, w in zip(b0[1:], w0[1:])])
    one_f_one_b = Candidate(1, 2, 1, 4, "1f1b", cuts=c.cuts[:1])
    assert split.stage_times(one_f_one_b) == plain.stage_times(one_f_one_b)  # nothing split, nothing added
