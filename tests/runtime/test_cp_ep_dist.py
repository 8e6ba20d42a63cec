"""Context parallelism with expert parallelism trains like one device (Mixtral, its router loss on).

ep is carved out of dp at one cp coordinate (autopar/parallel_dims.py says why); an expert's gradient is summed
over the ranks holding the same experts and other tokens, ``edcp`` = edp x cp, and divided by dp x cp
(runtime/state/moe_groups.py); ZeRO partitions the experts over edcp. Judged by the shared harness
(tests/equivalence.py: every rank and replica, fp32 relative 1e-5, 3 steps); the reference is one device.
"""
from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import pytest
import torch

from autopar.errors import PlanError
from autopar.parallel_dims import AXES, ParallelDims
from autopar.plan_model import MeshShape
from autopar.runtime.execution.rank_context import MeshInfo, RankContext
from autopar.runtime.state import grad_sync
from autopar.runtime.state.grad_sync import GradientSync
from autopar.runtime.state.zero import owned_experts
from case_marks import by_world
from equivalence import Case, assert_equivalent, run_cases

pytestmark = pytest.mark.dist

# Mixtral's load-balancing loss on, weighed enough that a wrong router statistic shows at fp32 (its default
# coefficient is 0.001); each rank runs its rows as one microbatch, so the statistics are the whole batch's
AUX = (("output_router_logits", True), ("router_aux_loss_coef", 0.5))
_FAM = "cp_family_runners:cp_train"
_EP = "cp_ep_runners:cp_ep_train"


CLIP = 0.05  # max_grad_norm: below every step's global gradient norm here (asserted), so clipping bites


def _case(kind, *, dp=1, ep=1, zero=0, strategy=None, clip=None):
    options = (("num_microbatches", 1), ("zero_stage", zero)) + ((("expert_parallel", ep),) if ep > 1 else ()) \
        + ((("cp_strategy", strategy),) if strategy else ()) + ((("max_grad_norm", clip),) if clip else ())
    return Case(model="mixtral", mesh=(dp, 1, 1), cp=2, kind=kind, seq=24, batch=4, options=options, overrides=AUX)


CASES = [
    # 2 ranks: the router loss over cp at ep=1 (its token means all-reduced over cp)
    _case(_FAM, strategy="all_to_all"),
    # 4 ranks (slow): dp=2 x cp=2 with ep=2, the experts' gradients over edp x cp
    _case(_EP, dp=2, ep=2, strategy="all_to_all"),
    _case(_EP, dp=2, ep=2, strategy="ring"),
    _case(_EP, dp=2, ep=2, zero=2, strategy="ring"),
    _case(_EP, dp=2, ep=2, zero=2, strategy="all_to_all"),
    _case(_EP, dp=2, ep=2, zero=3, strategy="all_to_all"),
    # clipping: the global norm counts each expert once among its edp x cp holders (or on its ZeRO owner)
    _case(_EP, dp=2, ep=2, clip=CLIP, strategy="all_to_all"),
    _case(_EP, dp=2, ep=2, zero=2, clip=CLIP, strategy="ring"),
    # 8 ranks (slow): dp=4 x cp=2 with ep=2, two ranks per edp group: edcp flattens edp and cp around ep
    _case(_EP, dp=4, ep=2, zero=1, strategy="ring"),
]


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = [c for c in CASES if c.world_size == world]
    return dict(zip(cases, run_cases(cases)))


@pytest.mark.parametrize("case", by_world(CASES, ids=Case.name, slow_worlds=(4, 8)))
def test_cp_with_experts_matches_single_device(case: Case):
    from cp_family_runners import cp_reference
    result, reference = _results(case.world_size)[case], cp_reference(case)
    assert_equivalent(case, result, reference)
    if reference["grad_norms"]:  # clipping: the norm autopar clipped by is torch's (each expert counted once)
        assert all(n > CLIP for n in reference["grad_norms"]), reference["grad_norms"]
        for rank, mine in enumerate(result["rank_results"]):
            assert mine["last_grad_norm"] == pytest.approx(reference["grad_norms"][-1], rel=1e-5), rank
    options = dict(case.options)
    dims = ParallelDims(dp=case.mesh[0], cp=case.cp, ep=options.get("expert_parallel", 1))
    for rank, mine in enumerate(result["rank_results"]):  # the live groups, built from the one DeviceMesh
        if dims.ep > 1:
            assert {axis: mine["groups"][axis] for axis in ("ep", "edp", "edcp", "dcp")} == {
                axis: dims.axis_ranks(axis, rank) for axis in ("ep", "edp", "edcp", "dcp")}, rank


@pytest.mark.parametrize("case", by_world([c for c in CASES if dict(c.options).get("expert_parallel")], ids=Case.name,
                                          slow_worlds=(4, 8)))
def test_model_states_match_the_calculator(case: Case):
    """Every rank's measured parameters, gradients and optimizer state equal the memory calculator's figures to
    the byte: the experts 1/ep per rank, their ZeRO partition (ZeRO-3: their shards) over edp x cp."""
    import autopar
    from autopar.memory import estimate_memory
    from cp_family_runners import _model, cp_batches
    result = _results(case.world_size)[case]
    assert "error" not in result, result.get("traceback")
    plan = autopar.plan(_model(case), {"dp": case.mesh[0], "cp": case.cp}, example_inputs=cp_batches(case)[0],
                        **dict(case.options))
    predicted = estimate_memory(plan, optimizer="momentum")  # cp_family_runners' SGD with momentum
    for rank, seen in enumerate(result["rank_results"]):
        for field in ("params", "master_params", "grads", "optimizer"):
            assert getattr(seen["states"], field) == getattr(predicted.ranks[rank], field), (rank, field)


# -- the group arithmetic, in one process: which ranks sum which expert gradients -------------------------
MESHES = [dict(dp=2, cp=2, ep=2), dict(dp=4, cp=2, ep=2), dict(dp=4, cp=2, ep=4), dict(dp=2, cp=3, ep=2, tp=2)]


def _expert_sync(dims: ParallelDims, rank: int, monkeypatch) -> dict:
    """What GradientSync hands sync_expert_gradients on ``rank``: each axis's group named by its global ranks."""
    calls = []
    monkeypatch.setattr(grad_sync, "sync_expert_gradients", lambda params, **kw: calls.append(kw))
    info = MeshInfo(MeshShape(dp=dims.dp, cp=dims.cp, pp=dims.pp, tp=dims.tp), rank, dims.coords(rank), dims=dims,
                    groups={axis: tuple(dims.axis_ranks(axis, rank)) for axis in AXES},
                    axis_ranks={axis: dims.axis_ranks(axis, rank) for axis in AXES})
    plan = SimpleNamespace(mesh=MeshShape(dp=dims.dp, cp=dims.cp, pp=dims.pp, tp=dims.tp), dims=dims, zero_stage=0,
                           data_parallel="ddp", bucket_mb=25.0, expert_params=("expert",))
    expert = torch.nn.Parameter(torch.zeros(2))
    sync = GradientSync([("expert", expert)], ctx=RankContext.create(info, timeout_s=5.0), shared=[], plan=plan,
                        owners=None, uses={})
    sync.finish()
    assert len(calls) == 1 and calls[0]["size"] == len(calls[0]["group"])
    return calls[0]


@pytest.mark.parametrize("degrees", MESHES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_an_expert_gradient_sums_every_token_once_over_the_ranks_holding_that_expert(degrees, monkeypatch):
    """An expert's rank gets the tokens of every (dp, cp) shard of its ep group; its gradient must be summed over
    every rank holding the same experts (same ep index, pp, tp) so that each (dp, cp) shard of the batch counts
    exactly once, and divided by dp x cp as DDP divides the rest. Summed over edp alone, the other cp shards'
    tokens are missing."""
    dims = ParallelDims(**degrees)
    for rank in range(dims.world_size):
        call = _expert_sync(dims, rank, monkeypatch)
        mine = dims.coords(rank)
        holders = [r for r in range(dims.world_size) if all(
            dims.index(axis, dims.coords(r)) == dims.index(axis, mine) for axis in ("ep", "pp", "tp"))]
        assert sorted(call["group"]) == holders, (rank, call["group"])
        shards = sorted((dims.index("dp", dims.coords(s)), dims.index("cp", dims.coords(s)))
                        for h in call["group"] for s in dims.axis_ranks("ep", h))
        assert shards == list(itertools.product(range(dims.dp), range(dims.cp))), (rank, shards)
        assert call["dp"] == dims.dp * dims.cp


@pytest.mark.parametrize("degrees", MESHES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_zero_owns_each_expert_tensor_once_among_its_holders(degrees):
    """ZeRO-1/2 step an expert tensor on one of the ranks holding it (the runtime's and the memory calculator's
    rule); partitioned over edp alone, every cp rank would step it (and keep its state)."""
    dims = ParallelDims(**degrees)
    experts = [(f"e{i}", torch.nn.Parameter(torch.zeros(3 + i))) for i in range(5)]
    for group in dims.groups("edcp"):
        owners = [n for r in group for n in owned_experts(experts, dims=dims, coords=dims.coords(r))]
        assert sorted(owners) == sorted(n for n, _ in experts), (group, owners)


@pytest.mark.parametrize("mesh", [dict(dp=2, cp=2, tp=2), dict(dp=2, cp=2, pp=2)])
def test_cp_with_experts_on_tp_or_pp_is_refused_before_capture(mesh):
    from autopar.validation import checked_options
    with pytest.raises(PlanError) as info:
        checked_options(dict(expert_parallel=2), mesh=MeshShape(**mesh), where="compile")
    assert "is not wired yet" in info.value.what and "drop tp and pp" in info.value.fix
    checked_options(dict(expert_parallel=2), mesh=MeshShape(dp=2, cp=2), where="compile")  # dp x cp runs


# -- the router loss's ops on the sequence (passes/context_parallel/seq_rules.py) ------------------------------
class _RouterCounts(torch.nn.Module):
    """Mixtral's padded router statistics in small: the mask repeated per chosen expert, scattered into expert bins
    (a sum over positions); ``combine``: rows scattered back into token order instead (no sum: refused)."""

    def __init__(self, combine: bool = False):
        super().__init__()
        self.emb, self.router, self.combine = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4), combine

    def forward(self, ids, mask):
        h = self.emb(ids).reshape(-1, 8)
        chosen = self.router(h).topk(2, dim=-1).indices.reshape(-1)
        weights = mask.reshape(-1).float().repeat_interleave(2)
        if self.combine:  # each row's two weights summed back into its own row
            rows = (ids.reshape(-1) * 0 + torch.arange(h.shape[0])).repeat_interleave(2)
            return torch.zeros(h.shape[0]).scatter_add_(0, rows, weights)
        return torch.zeros(4).scatter_add_(0, chosen, weights)


def _sequence_report(model):
    from autopar.passes.context_parallel.seq_dims import analyze_sequence
    from autopar.passes.frontend.capture import capture
    ids, mask = torch.randint(0, 16, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    gm = capture(model, (ids, mask)).gm
    return gm, analyze_sequence(gm, seq_inputs={n.name: 1 for n in gm.graph.nodes if n.op == "placeholder"})


def test_a_scatter_add_of_positions_into_bins_is_a_sum_over_cp_and_repeats_follow_the_shard():
    gm, report = _sequence_report(_RouterCounts())
    assert not report.refusals, report.refusals
    repeated = next(n.name for n in gm.graph.nodes if "repeat_interleave" in str(n.target))
    scattered = next(n.name for n in gm.graph.nodes if "scatter_add" in str(n.target))
    assert (report.info(repeated).rule, report.info(repeated).dim) == ("pointwise", 0)
    assert (report.info(scattered).rule, report.info(scattered).dim) == ("reduce", None)


def test_a_scatter_add_back_into_token_order_is_refused():
    _, report = _sequence_report(_RouterCounts(combine=True))
    assert any("not a sum into bins" in r.reason for r in report.refusals), report.refusals
