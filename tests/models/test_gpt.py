"""GPT: shapes, tied head, GPT-2 init, attention against a written-out reference, meta build."""
from __future__ import annotations

import math

import pytest
import torch

from autopar.models import GPT, GPTConfig, build_model

TINY = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, hidden=32)


def test_forward_shape():
    model = GPT(TINY)
    logits = model(torch.randint(0, 64, (3, 10)))
    assert logits.shape == (3, 10, 64)


def test_head_is_tied_to_token_embedding():
    model = GPT(TINY)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once


def test_init_is_gpt2_like_and_seeded():
    torch.manual_seed(0)
    a = GPT(TINY)
    torch.manual_seed(0)
    b = GPT(TINY)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.blocks[0].attn.qkv.bias.abs().max() == 0
    assert a.blocks[0].ln_1.weight.eq(1).all()
    big = GPT(GPTConfig(vocab_size=4096, seq_len=16, num_layers=2, num_heads=4, hidden=64))
    assert big.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.1)


def test_attention_matches_written_out_causal_attention():
    torch.manual_seed(0)
    attn = GPT(TINY).blocks[0].attn
    x = torch.randn(2, 5, 32)
    q, k, v = attn.qkv(x).split(32, dim=2)
    heads = [t.view(2, 5, 4, 8).transpose(1, 2) for t in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(2, 5, 32)
    torch.testing.assert_close(attn(x), attn.proj(y))


def test_too_long_sequence_is_refused():
    with pytest.raises(AssertionError, match="seq_len"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=8, seq_len=8, num_layers=1, num_heads=3, hidden=32)


def test_dropout_only_in_training():
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, num_layers=1, num_heads=4, hidden=32,
                          dropout=0.5))
    idx = torch.randint(0, 64, (2, 8))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.equal(model(idx), model(idx))


def test_meta_build_gpt2_small_allocates_nothing():
    with torch.device("meta"):
        model = build_model("gpt2_small")
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_materialize_from_meta_equals_direct_build():
    with torch.device("meta"):
        lazy = GPT(TINY)
    lazy.to_empty(device="cpu")
    lazy.tie_weights()
    torch.manual_seed(3)
    lazy.reset_parameters()
    torch.manual_seed(3)
    eager = GPT(TINY)
    assert lazy.lm_head.weight is lazy.tok_emb.weight
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
