"""The data-parallel family: DataParallel, DDP and ZeRO 1/2/3 train like one device, alone and with
pp and tp; DDP's buckets overlap backward; dp traffic and model-state memory follow ZeRO's theory.

Every spawned case runs the probe runner (tests/dp_probe.py), which trains exactly like the
harness's ``parallel_run`` and also reports each rank's comm log, memory and bucket launches.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from case_marks import by_world  # noqa: E402
from equivalence import RTOL, Case, assert_equivalent, reference_run, run_cases

pytestmark = pytest.mark.dist

PROBE = "dp_probe:probe_run"
SMALL_BUCKETS = ("bucket_mb", 0.01)  # ~10 KB: gpt_tiny's 120 KB of weights make a dozen buckets


def _case(mesh, *opts, optimizer="sgd", steps=3) -> Case:
    return Case(model="gpt_tiny", mesh=mesh, options=tuple(opts), kind=PROBE, optimizer=optimizer, steps=steps)


def _z(stage):
    return ("zero_stage", stage)


DP = ("data_parallel", "dataparallel")
ONE_MB = ("num_microbatches", 1)
# each ZeRO stage alone, one microbatch (ZeRO-3's traffic is per microbatch): equivalence, the comm
# audit and memory; DDP with small buckets and 2 microbatches shows the overlap
AUDIT = {(dp, z, "sgd"): _case((dp, 1, 1), _z(z), *((SMALL_BUCKETS,) if z == 0 and dp == 2 else (ONE_MB,)))
         for dp in (2, 4) for z in (0, 1, 2, 3)}
# fp32 AdamW under each ZeRO stage: memory, and judged against ZeRO-0 on the same mesh and one device
AUDIT.update({(2, z, "adamw"): _case((2, 1, 1), _z(z), ONE_MB, optimizer="adamw", steps=3) for z in range(4)})
DDP_PP = _case((2, 2, 1), _z(0), SMALL_BUCKETS, ("num_microbatches", 4))
EQUIVALENCE = [c for c in AUDIT.values() if c.optimizer == "sgd"] + [
    _case((2, 1, 1), DP), _case((4, 1, 1), DP), _case((2, 1, 2), DP),
    DDP_PP, _case((2, 2, 1), _z(2)),
    _case((2, 2, 1), _z(3), ("schedule", "interleaved_1f1b")),
    _case((2, 1, 2), _z(2)), _case((2, 2, 2), _z(3)),
]
OVERLAP = [AUDIT[(2, 0, "sgd")], DDP_PP]
DP_INFER = Case(model="gpt_tiny", mesh=(2, 1, 1), kind="dp_probe:dataparallel_infer_run")


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = list(dict.fromkeys(c for c in EQUIVALENCE + list(AUDIT.values()) + [DP_INFER] if c.world_size == world))
    return dict(zip(cases, run_cases(cases)))


def _result(case: Case) -> dict:
    result = _results(case.world_size)[case]
    assert "error" not in result, f"{case.name()} failed:\n{result.get('traceback', result['error'])}"
    return result


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
    return reference_run(Case(model="gpt_tiny"))


@pytest.mark.parametrize("case", by_world(EQUIVALENCE, ids=lambda c: c.name(), slow_worlds=(4, 8)))
def test_matches_single_device(case: Case):
    assert_equivalent(case, _result(case), _reference())


# -- fp32 AdamW under ZeRO ------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adamw_under_zero_steps_exactly_as_zero0(stage: int):
    """ZeRO-1/2/3 shard AdamW's state (exp_avg, exp_avg_sq, step) over dp=2; the weights and losses after
    three steps equal ZeRO-0's on the same mesh bit for bit. Why exact, ZeRO-3 included: at dp=2 every
    gradient reduction (all-reduce, reduce to the owner, reduce-scatter) is one addition of the same two
    operands, and fp32 addition commutes; AdamW is elementwise (ZeRO-3 checks that it is), so stepping a
    whole parameter on its owner or a flat 1/2 shard on each rank computes the same numbers."""
    expected, got = _result(AUDIT[(2, 0, "adamw")]), _result(AUDIT[(2, stage, "adamw")])
    assert got["losses"] == expected["losses"]
    assert set(got["state"]) == set(expected["state"])
    differ = [k for k, v in expected["state"].items() if not torch.equal(got["state"][k], v)]
    assert not differ, f"ZeRO-{stage} AdamW weights differ from ZeRO-0's: {differ}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adamw_under_zero_losses_match_single_device(stage: int):
    """Against one device only the losses are judged (fp32, relative 1e-5): Adam divides each gradient by
    its own magnitude, so a near-zero gradient's rounding noise becomes an O(lr) weight step (see
    tests/equivalence.py); the loss, a mean over every weight, stays at rounding size (5.7e-7 here)."""
    case = AUDIT[(2, stage, "adamw")]
    reference = _adamw_reference(case.steps)
    torch.testing.assert_close(torch.tensor(_result(case)["losses"]), torch.tensor(reference["losses"]),
                               rtol=RTOL, atol=0)


@functools.lru_cache(maxsize=None)
def _adamw_reference(steps: int) -> dict:
    return reference_run(Case(model="gpt_tiny", optimizer="adamw", steps=steps))


def test_dataparallel_inference_returns_the_whole_batch_everywhere():
    from equivalence import reference_outputs
    expected = reference_outputs(DP_INFER)
    for outputs in _result(DP_INFER)["outputs"]:
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- DDP overlaps communication with backward ------------------------------------------------------
@pytest.mark.parametrize("case", by_world(OVERLAP, ids=lambda c: c.name(), slow_worlds=(4, 8)))
def test_ddp_buckets_launch_during_the_last_backward(case: Case):
    """Every bucket starts inside the last microbatch's B action of its stage, before it ends."""
    m = dict(case.options).get("num_microbatches", 2)
    assert dict(case.options)["zero_stage"] == 0 and m > 1
    for rank in _result(case)["ranks"]:
        launches, events = rank["launches"], rank["events"]
        assert len(launches) >= 2, launches
        last_b = [e for e in events if e[0].split("B")[-1] == str(m - 1) and "B" in e[0]]
        assert len(last_b) == 1, events
        name, _, end = last_b[0]
        assert all(action == name for _, action, _ in launches), (name, launches)
        assert min(t for _, _, t in launches) < end
        earlier_b = [e for e in events if "B" in e[0] and e[0] != name]
        assert all(t > e[2] for e in earlier_b for _, _, t in launches), "a bucket started before the last B"


# -- communication audit ------------------------------------------------------------------------
def _param_bytes(rank: dict) -> int:
    return 4 * sum(rank["param_numels"].values())


@pytest.mark.parametrize("dp", [2, pytest.param(4, marks=pytest.mark.slow)])  # dp=4: the 4-rank group (slow)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_bytes_match_zero_theory(dp: int, stage: int):
    """DDP, ZeRO-1, ZeRO-2 send 2Ψ(N-1)/N per step; ZeRO-3 3Ψ(N-1)/N (1.5x), Ψ padded to N."""
    from autopar.ops.comm_audit import theory_bytes
    base = _result(AUDIT[(dp, 0, "sgd")])["ranks"]
    for rank, ref in zip(_result(AUDIT[(dp, stage, "sgd")])["ranks"], base):
        psi = _param_bytes(ref)
        if stage == 3:
            psi = 4 * sum(math.ceil(n / dp) * dp for n in ref["param_numels"].values())
        expected = theory_bytes(zero_stage=stage, param_bytes=psi, dp=dp)
        assert rank["sent"] == pytest.approx(expected, rel=1e-9), rank["comm"]
        # the paper's 1.5x for ZeRO-3, times the padding of Ψ to a multiple of N
        ratio = 1.5 * psi / _param_bytes(ref) if stage == 3 else 1.0
        assert rank["sent"] / ref["sent"] == pytest.approx(ratio, rel=1e-9)
        purposes = {0: {"grad_all_reduce"}, 1: {"grad_reduce", "param_broadcast"},
                    2: {"grad_reduce", "param_broadcast"},
                    3: {"zero3_gather_forward", "zero3_gather_backward", "zero3_reduce_scatter"}}[stage]
        assert set(rank["comm"]) == purposes


# -- measured model-state memory ----------------------------------------------------------------------
@pytest.mark.parametrize("dp,optimizer,k", [(2, "sgd", 4), pytest.param(4, "sgd", 4, marks=pytest.mark.slow),
                                              (2, "adamw", 8)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_memory_follows_zero(stage: int, dp: int, optimizer: str, k: int):
    """Bytes held per rank: exactly what each stage keeps, and the ZeRO formula's share of DDP."""
    base = _result(AUDIT[(dp, 0, optimizer)])["ranks"]
    for rank, ref in zip(_result(AUDIT[(dp, stage, optimizer)])["ranks"], base):
        numel = sum(ref["param_numels"].values())
        owned = sum(ref["param_numels"][n] for n in rank["owned"]) if stage in (1, 2) else numel
        padded = sum(math.ceil(n / dp) for n in ref["param_numels"].values())
        params, grads, opt = {0: (numel, numel, numel), 1: (numel, numel, owned), 2: (numel, owned, owned),
                              3: (padded, padded, padded)}[stage]
        mem = rank["memory"]
        assert mem["params"] == 4 * params and mem["grads"] == 4 * grads, (stage, mem)
        stepped = len(rank["owned"]) if stage in (1, 2) else len(ref["param_numels"])
        counters = 4 * stepped if optimizer == "adamw" else 0  # AdamW's fp32 ``step`` tensor per parameter
        assert mem["optimizer"] == k * opt + counters, (stage, mem)
        n = dp if stage else 1
        share = {0: 8 + k, 1: 8 + k / n, 2: 4 + (4 + k) / n, 3: (8 + k) / n}[stage] / (8 + k)
        # the ZeRO paper's shares assume an exact 1/N split: the bytes held differ from it by at most one
        # parameter's gradient and state (ZeRO-1/2 own whole parameters: test_zero_ownership_is_balanced),
        # ZeRO-3's padding of each parameter to a multiple of N, and AdamW's step counters
        numels = ref["param_numels"].values()
        slack = (4 + k) * max(numels) + (8 + k) * dp * len(numels) + 4 * len(numels)
        assert abs(mem["total"] - share * ref["memory"]["total"]) <= slack, (stage, mem)


@pytest.mark.parametrize("dp", [2, pytest.param(4, marks=pytest.mark.slow)])  # dp=4: the 4-rank group (slow)
def test_zero_ownership_is_balanced(dp: int):
    """ZeRO-1/2 own whole parameters: a rank's share is 1/N of the weights within one parameter."""
    for rank in _result(AUDIT[(dp, 1, "sgd")])["ranks"]:
        numels = rank["param_numels"]
        owned = sum(numels[n] for n in rank["owned"])
        assert abs(owned - sum(numels.values()) / dp) <= max(numels.values())
