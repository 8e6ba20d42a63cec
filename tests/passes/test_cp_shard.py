"""passes/context_parallel/cp_shard.py: the graph of one cp rank, read through ``autopar.plan``; every
refusal a clear autopar error at plan time naming the node (or input) and the fix.

The training runs equal to one device are tests/runtime/test_cp_dist.py's (the shared harness).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import PlanError, ShardingError
from autopar.models import build_model, lm_loss


def _tokens(seq: int, batch: int = 4, vocab: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def _plan(model, mesh, seq: int, **options):
    x, y = _tokens(seq, vocab=model.cfg.vocab_size if hasattr(model, "cfg") else 64)
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, **options)


def _calls(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_each_cp_rank_holds_its_part_and_attention_is_a_cp_node():
    result = _plan(build_model("gpt_tiny", seq_len=16), {"cp": 2}, 16, cp_strategy="ring")
    assert result.plan.mesh.cp == 2 and result.plan.cp_inputs == (("idx", 1), ("target", 1))
    assert result.plan.cp_seq_len == 16 and "context parallel: the sequence cut over cp=2" in result.plan.summary()
    for rank, part in ((0, [0, 1, 2, 3, 12, 13, 14, 15]), (1, [4, 5, 6, 7, 8, 9, 10, 11])):
        gm = result.ranks[rank].stages[0].gm
        kinds = [type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"]
        assert kinds == ["RingAttention", "RingAttention"], kinds
        assert not any("scaled_dot_product" in c for c in _calls(gm))
        starts = [n.args for n in gm.graph.nodes if n.op == "call_function" and "arange" in str(n.target)]
        assert sorted(i for a, b in starts for i in range(a, b)) == part  # the rank's global positions
        ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
        assert tuple(ph.meta["autopar.tensor"].shape) == (2, 8)  # a microbatch (2 rows) of the rank's 8 positions


def test_auto_takes_all_to_all_where_the_heads_divide():
    gm = _plan(build_model("gpt_tiny", seq_len=16), {"cp": 2}, 16).ranks[0].stages[0].gm
    kinds = {type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"}
    assert kinds == {"UlyssesAttention"}


def test_a_sequence_not_divisible_by_2_x_cp_is_refused_at_plan_time():
    with pytest.raises(PlanError) as info:
        _plan(build_model("gpt_tiny", seq_len=20), {"cp": 3}, 20)
    assert "does not divide by 2 x cp" in info.value.what and "20 tokens" in info.value.what
    assert "pad every sequence to a multiple of 6" in info.value.fix and "idx" in info.value.where


def test_heads_that_do_not_split_over_cp_are_refused_for_all_to_all():
    with pytest.raises(ShardingError) as info:
        _plan(build_model("gpt_tiny", seq_len=24), {"cp": 3}, 24, cp_strategy="all_to_all")
    assert "query heads per tp rank (4) to divide by cp=3" in info.value.what
    assert "scaled_dot_product_attention" in info.value.where and "cp_strategy='ring'" in info.value.fix
    _plan(build_model("gpt_tiny", seq_len=24), {"cp": 3}, 24)  # auto: the ring


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_a_cp_rank_is_costed_at_its_share_of_the_work(strategy):
    """The stage cuts balance the FLOPs the lowering records: a cp rank's attention node costs 1/cp of the
    whole attention (its queries against every key), as its linears cost 1/cp (without it the node cost 0, and
    Mixtral's pp=2 x cp=2 cut put every block on one stage)."""
    from autopar.ir.meta_keys import COST, get_meta

    def flops(mesh, **options) -> dict[str, int]:
        gm = _plan(build_model("gpt_tiny", seq_len=16), mesh, 16, **options).ranks[0].stages[0].gm
        out = {"attention": 0, "other": 0}
        for n in gm.graph.nodes:
            attention = n.op == "call_module" or "scaled_dot_product" in str(n.target)
            out["attention" if attention else "other"] += get_meta(n, COST).flops if get_meta(n, COST) else 0
        return out

    whole, rank = flops({"dp": 1}), flops({"cp": 2}, cp_strategy=strategy)
    assert whole["attention"] > 0 and rank == {"attention": whole["attention"] // 2, "other": whole["other"] // 2}


class _ConvOverTime(nn.Module):
    """Token embedding, one causal attention, a convolution over the sequence, a head."""

    def __init__(self, vocab: int = 64, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb, self.qkv = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)
        self.conv, self.head = nn.Conv1d(dim, dim, 3, padding=1), nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.emb(x)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


class _RunningSum(_ConvOverTime):
    """The same with the convolution replaced by a running sum along the sequence (a scan)."""

    def forward(self, x):
        h = self.emb(x)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return self.head(h + h.cumsum(dim=1))


@pytest.mark.parametrize("model,node,words", [
    (_ConvOverTime, "conv1d", "convolves over the sequence"),
    (_RunningSum, "cumsum", "not wired yet"),
])
def test_an_op_cp_cannot_shard_on_the_sequence_is_refused_with_its_node(model, node, words):
    torch.manual_seed(0)
    with pytest.raises(ShardingError) as info:
        _plan(model(), {"cp": 2}, 16)
    assert f"at node {node}" in info.value.what and words in info.value.what.lower(), info.value.what
    assert f"node {node}" in info.value.where and info.value.fix


@pytest.mark.parametrize("options,words", [
    (dict(schedule="pipedream"), "asynchronous schedule 'pipedream' is not wired yet"),
    (dict(data_parallel="dataparallel"), "needs data_parallel='ddp'"),
    (dict(dynamic_shapes="seq"), "dynamic_shapes='seq' keeps it symbolic"),
])
def test_options_cp_cannot_run_with_are_refused_before_capture(options, words):
    with pytest.raises(PlanError) as info:
        _plan(build_model("gpt_tiny", seq_len=16), {"cp": 2, **({"pp": 2} if "schedule" in options else {})}, 16,
              **options)
    assert words in info.value.what and info.value.fix


def test_the_planner_takes_a_pinned_cp():
    result = _plan(build_model("gpt_tiny", seq_len=16), {"cp": 2, "world": 2}, 16, plan="auto")
    assert result.plan.mesh.cp == 2 and result.plan.mesh.world_size == 2 and len(result.ranks) == 2


def test_a_plan_without_cp_writes_its_mesh_as_before():
    from autopar.plan_model import MeshShape
    assert MeshShape(dp=2).model_dump() == {"dp": 2, "pp": 1, "tp": 1}
    assert MeshShape(dp=2, cp=2).model_dump() == {"dp": 2, "pp": 1, "tp": 1, "cp": 2}
    assert MeshShape.model_validate_json(MeshShape(cp=2).model_dump_json()).cp == 2
