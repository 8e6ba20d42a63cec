"""The memory calculator (autopar/memory/): the formulas, by ZeRO stage, precision and optimizer, in one process."""
from __future__ import annotations

import functools
import math

import pytest
import torch

import autopar
from autopar.memory import OPTIMIZER_STATE, estimate_memory, peak_bytes
from autopar.models import build_model, lm_loss
from autopar.runtime.schedules.registry import build_schedule
from autopar.runtime.schedules.simulator import StageCosts, simulate


@functools.lru_cache(maxsize=None)
def _plan(mesh, **options):
    torch.manual_seed(0)
    model = build_model("gpt_tiny", seq_len=16)
    x = torch.randint(0, 128, (8, 16))
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, **options)


def _sizes():
    model = build_model("gpt_tiny", seq_len=16)
    return [p.numel() for p in model.parameters()]  # tied weights once, as the runtime holds them


def test_zero0_fp32_adam_is_16_bytes_per_parameter():
    n = sum(_sizes())
    r = estimate_memory(_plan((2, 1, 1)), optimizer="adam", zero_stage=0).ranks[1]
    assert (r.params, r.master_params, r.grads) == (4 * n, 0, 4 * n)
    assert r.optimizer == 8 * n + 4 * len(_sizes())  # exp_avg, exp_avg_sq + a 4-byte step per tensor


_TORCH_OPTIMIZERS = {  # the calculator's optimizer kinds as torch builds them (foreach off: one state per tensor)
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@functools.lru_cache(maxsize=None)
def _counted(optimizer: str) -> dict[str, int]:
    """Bytes counted from real tensors: gpt_tiny's parameters, gradients and the state torch's optimizer
    holds after one real step (the oracle owes nothing to the calculator's tables)."""
    torch.manual_seed(0)
    model = build_model("gpt_tiny", seq_len=16)
    x = torch.randint(0, 128, (8, 16))
    opt = _TORCH_OPTIMIZERS[optimizer](list(model.parameters()))
    lm_loss(model(x), x).backward()
    opt.step()
    state = [v for per_param in opt.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {"params": _nbytes(model.parameters()), "grads": _nbytes(p.grad for p in model.parameters()),
            "optimizer": _nbytes(state)}


def test_the_optimizer_kinds_are_the_ones_torch_builds():
    assert set(OPTIMIZER_STATE) == set(_TORCH_OPTIMIZERS)


@pytest.mark.parametrize("optimizer", sorted(_TORCH_OPTIMIZERS))
def test_zero0_bytes_match_a_real_model_after_a_real_step(optimizer):
    """Parameters, gradients and optimizer state of a dp rank without ZeRO: the bytes of the real tensors."""
    r = estimate_memory(_plan((2, 1, 1)), optimizer=optimizer, zero_stage=0).ranks[0]
    assert {"params": r.params, "grads": r.grads, "optimizer": r.optimizer} == _counted(optimizer)


def test_zero_stages_shard_what_they_say():
    """ZeRO-1 splits optimizer state over dp, ZeRO-2 gradients too, ZeRO-3 parameters too (ceil(n/dp))."""
    sizes = _sizes()
    result = _plan((2, 1, 1))
    by_stage = {z: estimate_memory(result, optimizer="adam", zero_stage=z).ranks for z in range(4)}
    full = by_stage[0][0]
    for z in (1, 2):
        ranks = by_stage[z].values()
        assert sum(r.optimizer for r in ranks) == full.optimizer  # whole parameters, each on one rank
        assert max(r.optimizer for r in ranks) < 0.6 * full.optimizer
        assert all(r.params == full.params for r in ranks)
    assert sum(r.grads for r in by_stage[2].values()) == full.grads
    assert all(r.grads == full.grads for r in by_stage[1].values())
    shard = sum(math.ceil(s / 2) for s in sizes)
    for r in by_stage[3].values():
        assert (r.params, r.grads) == (4 * shard, 4 * shard)
        assert r.optimizer == 8 * shard + 4 * len(sizes)


def test_bf16_keeps_bf16_params_fp32_masters_and_grads():
    n = sum(_sizes())
    r = estimate_memory(_plan((2, 1, 1), precision="bf16"), optimizer="adam", zero_stage=0).ranks[0]
    assert (r.params, r.master_params, r.grads) == (2 * n, 4 * n, 4 * n)
    fp32 = estimate_memory(_plan((2, 1, 1)), optimizer="adam", zero_stage=0).ranks[0]
    assert r.per_microbatch[0] < 0.55 * fp32.per_microbatch[0]  # bf16 activations (the loss stays small)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_bf16_masters_are_partitioned_with_the_optimizer_state(zero_stage):
    """The fp32 master is optimizer state (ZeRO's K = 12 for Adam): held where the parameter is stepped."""
    sizes = _sizes()
    ranks = estimate_memory(_plan((2, 1, 1), precision="bf16"), optimizer="adam", zero_stage=zero_stage).ranks
    assert sum(r.master_params for r in ranks.values()) == 4 * sum(
        math.ceil(s / 2) * 2 if zero_stage == 3 else s for s in sizes)
    for r in ranks.values():
        assert 0 < r.master_params < 0.6 * 4 * sum(sizes)
        steps = r.optimizer - 2 * r.master_params  # Adam: 2 x 4 bytes per master element + a 4-byte step per tensor
        assert steps % 4 == 0 and 0 < steps // 4 <= len(sizes) and (zero_stage < 3 or steps // 4 == len(sizes))


def test_pipeline_and_tensor_parallel_split_the_parameters():
    n = sum(_sizes())
    pp = estimate_memory(_plan((1, 2, 1)), optimizer="sgd").ranks
    tied = 128 * 32 * 4  # the tied embedding / LM head lives on both pipeline ranks
    assert sum(r.params for r in pp.values()) == 4 * n + tied
    tp = estimate_memory(_plan((1, 1, 2)), optimizer="sgd").ranks
    assert tp[0].params == tp[1].params < 0.7 * 4 * n


def test_peak_in_flight_is_the_simulators():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        schedule = build_schedule(name, num_ranks=4, num_microbatches=8, num_virtual=v)
        sim = simulate(schedule, costs=StageCosts(forward=1, backward=1, weight=1))
        for rank, row in enumerate(schedule.actions):
            ones = dict.fromkeys(range(schedule.num_stages), 1)
            assert peak_bytes(row, ones, split_backward=schedule.split_backward) == sim.peak_activations[rank]


def test_activations_follow_the_schedule():
    gpipe = estimate_memory(_plan((1, 2, 1), schedule="gpipe", num_microbatches=4), optimizer="sgd").ranks[0]
    ofob = estimate_memory(_plan((1, 2, 1), schedule="1f1b", num_microbatches=4), optimizer="sgd").ranks[0]
    assert (gpipe.peak_in_flight, ofob.peak_in_flight) == (4, 2)
    assert gpipe.activations == 4 * gpipe.per_microbatch[0]
    assert ofob.activations == 2 * ofob.per_microbatch[0]


def test_unknown_optimizer_is_a_plan_error():
    with pytest.raises(autopar.PlanError, match="optimizer"):
        estimate_memory(_plan((2, 1, 1)), optimizer="lion")


def test_70b_shaped_model_on_1024_ranks_on_meta():
    """A 70B-shaped Llama (8 of its 80 layers) on dp=128 x pp=8: figures from the graphs, nothing allocated."""
    with torch.device("meta"):
        model = build_model("llama2_70b", num_layers=8)
    x = torch.zeros(1024, model.cfg.seq_len, dtype=torch.long, device="meta")
    result = autopar.plan(model, (128, 8, 1), example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                          precision="bf16", recompute="selective", zero_stage=1, num_microbatches=8)
    estimate = estimate_memory(result, optimizer="adam")
    assert len(estimate.ranks) == 1024
    first = [estimate.ranks[autopar.planning.rank_of(dp=0, pp=q, tp=0, shape=result.plan.mesh)] for q in range(8)]
    assert sum(r.params for r in first) == 2 * sum(p.numel() for p in model.parameters())  # bf16
    for q, r in enumerate(first):  # ZeRO-1: each fp32 master on its owner only, 4 bytes per owned element
        column = [estimate.ranks[autopar.planning.rank_of(dp=d, pp=q, tp=0, shape=result.plan.mesh)]
                  for d in range(128)]
        assert sum(c.master_params for c in column) == 2 * r.params
        assert max(c.master_params for c in column) < 2 * r.params  # whole tensors spread over the owners
    layer = 8192 * (8192 * 2 + 1024 * 2 + 28672 * 3) + 8192 * 2  # attention, MLP, two norms
    assert first[3].params == 2 * layer
    assert first[3].peak_in_flight == 5  # 1F1B: pp - stage microbatches in flight
    assert "GiB" in estimate.summary()


@pytest.mark.parametrize("p", [2, 3, 4])
def test_asynchronous_weight_versions_are_the_published_bounds(p):
    """Weight-sized buffers besides the live weights, per stage s of p, written out from the schedules' rules:
    PipeDream p - s (its paper's stashed versions), 2BW 3 and 2 on the last stage (one copy and two update
    gradients, the last stage copying nothing), PipeMare 2 (a gradient and the velocity); synchronous none."""
    from autopar.memory.versions import steady_stream, weight_buffers

    def buffers(name, m):
        return weight_buffers(steady_stream(build_schedule(name, num_ranks=p, num_microbatches=m)))

    for m in (p, 2 * p):
        assert buffers("pipedream", m) == tuple(p - s for s in range(p))
        assert buffers("pipedream_2bw", m) == (3,) * (p - 1) + (2,)
        assert buffers("pipemare", m) == (2,) * p
        assert buffers("1f1b", m) == (0,) * p
    # one batch of 2BW never reads a version across an update: the steady stream is what a long run holds
    assert weight_buffers(build_schedule("pipedream_2bw", num_ranks=p, num_microbatches=p)) == (1,) * p


def test_asynchronous_ranks_hold_weight_versions_instead_of_gradients():
    sync = estimate_memory(_plan((1, 2, 1), schedule="1f1b"), optimizer="momentum")
    two_bw = estimate_memory(_plan((1, 2, 1), schedule="pipedream_2bw"), optimizer="momentum")
    for rank, expected in [(0, 3), (1, 2)]:
        r, s = two_bw.ranks[rank], sync.ranks[rank]
        assert (r.params, r.optimizer, r.grads, s.weight_versions) == (s.params, s.optimizer, 0, 0)
        assert r.weight_versions == expected * s.params  # fp32: a weight-sized buffer is the parameters' bytes
        assert r.total == r.params + r.optimizer + r.buffers + r.activations + r.weight_versions
