"""Llama: shapes, RMSNorm, rotary, grouped-query attention, meta build and materialization."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.models import Llama, LlamaConfig, build_model
from autopar.models.llama import RMSNorm, RotaryEmbedding, rotate_half

TINY = LlamaConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32,
                   intermediate=64)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_forward_shape(num_kv_heads):
    cfg = LlamaConfig(vocab_size=64, seq_len=16, num_layers=1, num_heads=4,
                      num_kv_heads=num_kv_heads, hidden=32, intermediate=64)
    model = Llama(cfg)
    assert model(torch.randint(0, 64, (3, 10))).shape == (3, 10, 64)
    assert model.layers[0].attn.k_proj.out_features == num_kv_heads * 8


def test_head_is_untied_and_has_no_biases():
    model = Llama(TINY)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_rms_norm_formula():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_()
    x = torch.randn(3, 8)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_rotary_rotates_pairs_and_keeps_norm():
    rope = RotaryEmbedding(head_dim=8, seq_len=16, theta=10000.0)
    assert rope.cos.shape == rope.sin.shape == (16, 8)
    assert "cos" not in rope.state_dict()
    cos, sin = rope(5)
    x = torch.randn(2, 4, 5, 8)
    y = x * cos + rotate_half(x) * sin
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated


def test_attention_equals_sdpa_with_native_gqa():
    torch.manual_seed(0)
    attn = Llama(TINY).layers[0].attn
    x = torch.randn(2, 6, 32)
    cos, sin = attn.rotary(6)
    q = attn.q_proj(x).view(2, 6, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 6, 2, 8).transpose(1, 2)
    v = attn.v_proj(x).view(2, 6, 2, 8).transpose(1, 2)
    q, k = (t * cos + rotate_half(t) * sin for t in (q, k))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attn(x), attn.o_proj(y.transpose(1, 2).reshape(2, 6, 32)))


def test_meta_build_llama2_70b_allocates_nothing():
    with torch.device("meta"):
        model = build_model("llama2_70b")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    count = sum(p.numel() for p in model.parameters())
    assert count == 68_976_648_192
    assert abs(count - 69e9) / 69e9 < 0.01


def test_materialize_from_meta_equals_direct_build():
    with torch.device("meta"):
        lazy = Llama(TINY)
    lazy.to_empty(device="cpu")
    torch.manual_seed(5)
    lazy.reset_parameters()
    torch.manual_seed(5)
    eager = Llama(TINY)
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(lazy.buffers(), eager.buffers()):
        assert torch.equal(a, b)
    idx = torch.randint(0, 64, (2, 7))
    assert torch.equal(lazy(idx), eager(idx))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="multiple of"):
        LlamaConfig(vocab_size=8, seq_len=8, num_layers=1, num_heads=4, num_kv_heads=3, hidden=32,
                    intermediate=8)
