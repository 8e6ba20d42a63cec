"""A fused qkv projection grouped by kv head shards in every layout families write it, found from the views.

The same grouped-query attention (4 query heads, 2 or 1 kv heads, a fused ``qkv`` linear) is written four
ways: blocked ``[q | k | v]`` (Phi-3), per kv group in one view ``(kv groups, queries + 2, head_dim)``
(Falcon's new decoder architecture before transformers 5.25), the same after a first view into
``(slots, head_dim)`` (transformers 5.25's Falcon), and per kv group with the queries taken by a slice and
k, v by ``select``. None of them is written as a family of its own in autopar: each must shard every
projection at tp=2 and at tp=4 (kv heads replicated within tp groups when fewer than tp; with a single kv
group the fused weight stays whole and each rank narrows its query heads), and the sharded graphs, run rank
by rank in this process, must give the eager model's loss.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from graph_runner import run_forward

HEADS, HEAD_DIM, HIDDEN, VOCAB, SEQ = 4, 8, 32, 64, 8
LAYOUTS = ("blocked", "group_view", "group_two_views", "group_select")


class GroupedAttention(nn.Module):
    def __init__(self, layout: str, kv_heads: int):
        super().__init__()
        self.layout, self.kv = layout, kv_heads
        self.group = HEADS // kv_heads
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * kv_heads) * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def _split(self, fused):
        b, s, _ = fused.shape
        if self.layout == "blocked":
            q, k, v = fused.split([HEADS * HEAD_DIM, self.kv * HEAD_DIM, self.kv * HEAD_DIM], dim=-1)
            return q.view(b, s, HEADS, HEAD_DIM), k.view(b, s, self.kv, HEAD_DIM), v.view(b, s, self.kv, HEAD_DIM)
        if self.layout == "group_two_views":
            fused = fused.view(b, s, -1, HEAD_DIM)
        grouped = fused.view(b, s, self.kv, self.group + 2, HEAD_DIM)
        if self.layout == "group_select":
            q = grouped[:, :, :, : self.group].reshape(b, s, HEADS, HEAD_DIM)
            return q, grouped.select(3, self.group), grouped.select(3, self.group + 1)
        q = grouped[..., :-2, :].flatten(-3, -2)
        return q, grouped[..., -2, :], grouped[..., -1, :]

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._split(self.qkv(x)))
        k = k[:, :, None].expand(b, self.kv, self.group, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        v = v[:, :, None].expand(b, self.kv, self.group, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class TinyLM(nn.Module):
    def __init__(self, layout: str, kv_heads: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(HIDDEN),
                                                   "attn": GroupedAttention(layout, kv_heads)}) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block["attn"](block["norm"](h))
        return self.head(h)


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


CASES = [(layout, kv, tp) for layout in LAYOUTS for kv, tp in ((2, 2), (2, 4), (1, 2))]


@pytest.mark.parametrize("layout,kv,tp", CASES, ids=[f"{lay}-kv{kv}-tp{tp}" for lay, kv, tp in CASES])
def test_fused_qkv_grouped_by_kv_head_shards_and_matches_one_device(layout, kv, tp):
    torch.manual_seed(0)
    model = TinyLM(layout, kv)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2))
    result = autopar.plan(model, {"tp": tp}, example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                          vocab_parallel=False, num_microbatches=1)
    # one kv group (kv=1) in a grouped layout: every rank needs the group's k and v, so the fused weight
    # stays whole and each rank narrows the projection's output to its own query heads
    names = ("out",) if kv == 1 and layout != "blocked" else ("qkv", "out")
    projections = [f"blocks.{i}.attn.{name}.weight" for i in range(2) for name in names]
    assert [n for n in projections if n not in result.plan.param_shards] == []
    with torch.no_grad():
        expected = loss_fn(model(x), y)
    losses = run_forward(result, {"idx": x, "target": y})
    for rank, (loss, *_) in enumerate(losses):
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=f"tp rank {rank}")
