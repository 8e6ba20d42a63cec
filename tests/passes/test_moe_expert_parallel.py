"""passes/moe/moe_expert_parallel.py and passes/moe/moe_aux.py read off autopar.plan (no process group), and the
expert-parallel refusals, each an AutoparError naming what to change."""
import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError, ShardingError
from autopar.models import build_model, lm_loss
from autopar.models.moe import build_moe, moe_loss
from autopar.ops.moe_ops import DpMean, MoeCombine, MoeDispatch
from autopar.passes.frontend.capture import capture
from autopar.passes.lowering_state import LoweringState
from autopar.passes.moe.moe_expert_parallel import shard_experts
from autopar.plan_model import MeshShape

EP = dict(expert_parallel=2, zero_stage=0, num_microbatches=1)


def _plan(model, dp, **options):
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 16))
    return autopar.plan(model, {"dp": dp}, example_inputs=(idx,), loss_fn=moe_loss, example_target=idx,
                        **{**EP, **options})


def _kinds(gm):
    return [type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"]


def test_rewritten_graph_shows_the_exchange():
    result = _plan(build_moe("deepseek"), 2)
    gm = result.ranks[0].stages[0].gm
    kinds = _kinds(gm)
    assert [k for k in kinds if k != "DpMean"] == ["MoeDispatch", "MoeCombine"] * 2
    assert kinds.count("DpMean") == 4  # f and P of each layer's load-balancing loss, averaged over dp
    assert "moe_dispatch_0" in gm.code and "moe_combine_1" in gm.code
    assert tuple(gm.get_parameter("model.blocks.0.moe.experts.w_in").shape) == (2, 32, 64)  # 4 experts / ep 2
    assert tuple(gm.get_parameter("model.blocks.0.moe.shared.up.weight").shape) == (64, 32)  # shared: whole
    plan = result.plan
    assert plan.expert_parallel == 2
    assert plan.expert_params == ("blocks.0.moe.experts.w_in", "blocks.0.moe.experts.w_out",
                                  "blocks.1.moe.experts.w_in", "blocks.1.moe.experts.w_out")
    assert "expert parallel: 4 expert tensors split over ep=2" in plan.summary()
    assert autopar.Plan.model_validate_json(plan.model_dump_json()) == plan


def test_ep_rank_picks_its_experts():
    torch.manual_seed(0)
    model = build_moe("switch")
    idx = torch.randint(0, 64, (2, 8))
    full = model.blocks[0].moe.experts.w_in.detach().clone()
    gm = capture(model, (idx,), loss_fn=moe_loss, example_target=idx).gm
    st = shard_experts(LoweringState.of_graph(gm, mesh=MeshShape(dp=2), dp_rank=1, expert_parallel=2))  # ep rank 1
    gm, experts = st.gm, st.experts
    assert torch.equal(gm.get_parameter(experts[0]), full[2:4])
    dispatch = next(m for m in gm.modules() if isinstance(m, MoeDispatch))
    assert (dispatch.axis, dispatch.size, dispatch.num_experts) == ("ep", 2, 4)
    assert sum(isinstance(m, MoeCombine) for m in gm.modules()) == 2


def test_plain_dp_averages_router_statistics_only():
    idx = torch.randint(0, 64, (8, 16))
    result = autopar.plan(build_moe("switch"), {"dp": 2}, example_inputs=(idx,), loss_fn=moe_loss,
                          example_target=idx, num_microbatches=1)
    kinds = _kinds(result.ranks[0].stages[0].gm)
    assert kinds == ["DpMean"] * 4 and result.plan.expert_params == ()


@pytest.mark.parametrize("options, match", [
    (dict(expert_parallel=3), "does not divide dp=2"),
])
def test_option_refusals(options, match):
    with pytest.raises(PlanError, match=match):
        _plan(build_moe("switch"), 2, **options)


def test_sequence_parallel_with_ep_and_tp_is_refused():
    idx = torch.randint(0, 64, (8, 16))
    with pytest.raises(PlanError, match="with sequence_parallel is not supported yet") as info:
        autopar.plan(build_moe("switch"), {"dp": 2, "tp": 2}, example_inputs=(idx,), loss_fn=moe_loss,
                     example_target=idx, sequence_parallel=True, **EP)
    assert "drop sequence_parallel" in info.value.fix


def test_experts_must_divide():
    with pytest.raises(ShardingError, match="4 experts, not divisible by expert_parallel=8"):
        _plan(build_moe("switch"), 8, expert_parallel=8)


def test_loop_over_experts_is_refused():
    with pytest.raises(ShardingError, match="runs every expert on every token") as info:
        _plan(build_moe("loop_moe"), 2)
    assert "fused 3-D tensors" in info.value.fix


def test_no_moe_layer():
    model = build_model("gpt_tiny")
    idx = torch.randint(0, model.cfg.vocab_size, (8, 16))
    with pytest.raises(ShardingError, match="no mixture-of-experts layer was recognised"):
        autopar.plan(model, {"dp": 2}, example_inputs=(idx,), loss_fn=lm_loss, example_target=idx, **EP)


class _ScaledInside(nn.Module):
    """Fused experts that multiply each row by a per-token value between the two expert matmuls."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.w_in = nn.Parameter(torch.randn(4, 8, 8))
        self.w_out = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), 1, dim=-1)
        h = torch.bmm(x.unsqueeze(1), self.w_in[ids[:, 0]]) * weights.unsqueeze(-1)
        return (torch.bmm(h, self.w_out[ids[:, 0]]).squeeze(1)).sum()


def test_per_token_value_between_expert_matmuls_is_refused():
    gm = capture(_ScaledInside(), (torch.randn(6, 8),)).gm
    with pytest.raises(ShardingError, match="not dispatched with the rows"):
        shard_experts(LoweringState.of_graph(gm, mesh=MeshShape(dp=2), dp_rank=0, expert_parallel=2))


def test_memory_calculator_counts_one_ep_th_of_the_experts():
    from autopar.memory import estimate_memory
    model = build_moe("switch")
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    split = estimate_memory(_plan(model, 2), optimizer="momentum").ranks[0]
    whole = estimate_memory(_plan(model, 2, expert_parallel=1), optimizer="momentum").ranks[0]
    assert whole.params - split.params == experts // 2
    assert whole.optimizer - split.optimizer == experts // 2  # the momentum of the experts this rank holds


def test_memory_calculator_counts_the_experts_split_over_ep_and_cut_over_tp():
    from autopar.memory import estimate_memory
    model = build_moe("switch")
    idx = torch.randint(0, 64, (8, 16))
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)  # fp32 bytes

    def params(ep):
        result = autopar.plan(model, {"dp": 2, "tp": 2}, example_inputs=(idx,), loss_fn=moe_loss, example_target=idx,
                              vocab_parallel=False, **{**EP, "expert_parallel": ep})
        return estimate_memory(result, optimizer="momentum").ranks[0].params
    # at tp=2 every rank holds half of each expert; ep=2 halves that again (nothing else here is cut over tp)
    assert params(1) - params(2) == experts // 4


def test_capacity_keeps_the_first_rows_of_each_expert():
    from autopar.ops.moe_ops import _keep
    ids = torch.tensor([2, 0, 2, 2, 1, 0, 2])
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=4)
    kept, sent = _keep(ids, order, counts, capacity=2)
    assert kept.tolist() == [1, 5, 4, 0, 2]  # expert 2 keeps rows 0 and 2 and drops 3 and 6
    assert sent.tolist() == [2, 1, 2, 0]
    assert _keep(ids, order, counts, None)[0].tolist() == order.tolist()


def test_capacity_factor_option():
    result = _plan(build_moe("switch"), 2, moe_capacity_factor=1.25)
    dispatch = next(m for m in result.ranks[0].stages[0].gm.modules() if isinstance(m, MoeDispatch))
    assert dispatch.capacity_factor == 1.25 and dispatch.capacity(64) == 20  # ceil(1.25 * 64 rows / 4 experts)
    assert result.plan.moe_capacity_factor == 1.25
    with pytest.raises(PlanError, match="moe_capacity_factor has no effect with expert_parallel=1"):
        _plan(build_moe("switch"), 2, expert_parallel=1, moe_capacity_factor=1.25)

