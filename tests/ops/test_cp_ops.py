"""Context parallelism's attention ops in one process: the block arithmetic, the graph nodes, the refusals.

The spawned cp=2 and cp=4 groups are tests/ops/test_cp_attention.py; here every case of
tests/cp_runners.py also runs at cp=1 (both strategies, the load-balanced layout's two chunks).
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar.errors import PlanError, RuntimeCommError
from autopar.ops.collectives import collective_nodes
from autopar.ops.context_parallel.block_math import AttentionSpec, KeyBlock, block_forward, grouped, merge
from autopar.ops.context_parallel.layout import CpLayout
from autopar.ops.context_parallel.ring import RingAttention, ring_attention
from autopar.ops.context_parallel.ulysses import UlyssesAttention, ulysses_attention
from cp_runners import CASES, _compare, run_one

SPEC = AttentionSpec(scale=0.35, causal=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_case_at_cp1_equals_the_oracle(case):
    for strategy in case.strategies:
        assert _compare(*run_one(case, strategy, None, 1, 0)) is None, strategy


def test_merging_blocks_of_keys_in_any_order_is_the_softmax_over_all_of_them():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 1, 5, 4, generator=g), torch.randn(1, 2, 12, 4, generator=g), torch.randn(
        1, 2, 12, 3, generator=g)
    pos = torch.arange(12)
    want = torch.softmax(torch.einsum("bhgqd,bhkd->bhgqk", q, k) * 0.5, -1) @ v.unsqueeze(2)
    spec = AttentionSpec(scale=0.5)
    for parts in ([0, 4, 12], [0, 7, 9, 12], [0, 12]):
        pieces = [block_forward(spec, q, k[:, :, a:b], v[:, :, a:b], torch.arange(5) + 20, KeyBlock(pos=pos[a:b]))
                  for a, b in zip(parts, parts[1:])]
        out, lse = pieces[-1]
        for piece in reversed(pieces[:-1]):
            out, lse = merge(out, lse, *piece)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_a_block_no_query_may_see_is_skipped_and_a_query_that_sees_nothing_gets_zero():
    q, k, v = torch.randn(1, 1, 1, 4, 2), torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2)
    assert block_forward(SPEC, q, k, v, torch.arange(4), KeyBlock(pos=torch.arange(4) + 4)) is None  # the future
    out, lse = block_forward(SPEC, q, k, v, torch.arange(4), KeyBlock(pos=torch.arange(4) + 2))
    assert torch.equal(out[..., :2, :], torch.zeros_like(out[..., :2, :])) and torch.isinf(lse[..., :2]).all()
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    merged, merged_lse = merge(empty_out, empty_lse, out, lse)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)


def test_grouped_query_heads_stay_with_their_kv_head():
    q = torch.arange(6.).view(1, 6, 1, 1)
    assert grouped(q, 2)[0, :, :, 0, 0].tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("cls", [RingAttention, UlyssesAttention])
def test_the_ops_are_graph_nodes_that_refuse_to_run_unbound(cls):
    layout = CpLayout(seq_len=8, cp=2)
    root = torch.nn.Module()
    root.attn = cls(axis="cp", size=2, layout=layout, spec=SPEC)
    graph = fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    graph.output(graph.call_module("attn", (q, k, v)))
    gm = fx.GraphModule(root, graph)
    assert "self.attn(q, k, v)" in gm.code and collective_nodes(gm, cls) == [next(iter(gm.graph.find_nodes(
        op="call_module")))]
    x = torch.zeros(1, 2, 4, 3)
    assert root.attn.meta_forward(x, x, torch.zeros(1, 2, 4, 5)).shape == (1, 2, 4, 5)
    with pytest.raises(RuntimeCommError, match="not bound to a process group"):
        gm(x, x, x)


@pytest.mark.parametrize("cls", [RingAttention, UlyssesAttention])
def test_dropout_and_a_layout_of_another_cp_are_refused(cls):
    with pytest.raises(PlanError, match=r"attention dropout p=0.1 .*attention_dropout=0.0"):
        cls(axis="cp", size=2, layout=CpLayout(seq_len=8, cp=2), spec=SPEC, dropout=0.1)
    with pytest.raises(PlanError, match="cut for cp=4, the axis has 2 ranks"):
        cls(axis="cp", size=2, layout=CpLayout(seq_len=8, cp=4), spec=SPEC)


def test_wrong_shapes_and_heads_are_refused_before_any_communication():
    layout = CpLayout(seq_len=12, cp=3)
    q = torch.zeros(1, 4, 4, 2)
    with pytest.raises(PlanError, match=r"4 query heads \(per tp rank\) do not divide by cp=3"):
        ulysses_attention(q, q, q, spec=SPEC, layout=layout, group=None)
    with pytest.raises(PlanError, match=r"2 kv heads neither divide by cp=3 nor divide it"):
        ulysses_attention(torch.zeros(1, 6, 4, 2), q[:, :2], q[:, :2], spec=SPEC, layout=layout, group=None)
    with pytest.raises(PlanError, match="4 local positions"):
        ring_attention(torch.zeros(1, 4, 5, 2), q, q, spec=SPEC, layout=layout, group=None)
    with pytest.raises(PlanError, match=r"query heads must be a multiple of the kv heads"):
        ring_attention(q, q[:, :3], q[:, :3], spec=SPEC, layout=layout, group=None)
    with pytest.raises(PlanError, match=r"mask/bias of shape \(1, 1, 4, 4\) is not \[B\|1, H\|1, 4\|1, 12\]"):
        ring_attention(q, q, q, spec=SPEC, layout=layout, group=None, bias=torch.zeros(1, 1, 4, 4))


def test_the_ops_say_what_they_send():
    ring = RingAttention(axis="cp", size=4, layout=CpLayout(seq_len=16, cp=4), spec=SPEC, kv_bytes=100)
    assert [(c.direction, c.op, c.nbytes) for c in ring.comm(64, 64)] == [
        ("forward", "send_recv", 300), ("backward", "send_recv", 300), ("backward", "send_recv", 400)]
    a2a = UlyssesAttention(axis="cp", size=4, layout=CpLayout(seq_len=16, cp=4), spec=SPEC)
    assert [(c.direction, c.op, c.nbytes) for c in a2a.comm(64, 32)] == [("forward", "all_to_all", 224),
                                                                        ("backward", "all_to_all", 224)]
