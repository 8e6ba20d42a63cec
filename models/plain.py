"""A decoder written unlike GPT and Llama, to show tensor parallelism needs no model-specific rules.

Where GPT uses a fused qkv and ``scaled_dot_product_attention``, this model has separate bias-free
``wq``/``wk``/``wv``/``wo`` projections, attention written out by hand (``q @ k^T``, a causal
mask built in forward, ``softmax``, dropout on the probabilities, ``@ v``), heads moved with
``permute`` and ``reshape``, a squared-ReLU feed-forward with biases under other names, a
position table sliced rather than looked up, bias-free LayerNorms and an untied output head.

Module paths::

    tok, pos (a parameter), h.{i}.norm1, h.{i}.mix.{wq,wk,wv,wo}, h.{i}.norm2, h.{i}.ffn.{w_in,w_out},
    norm_out, out

Example::

    >>> import torch
    >>> cfg = PlainConfig(vocab_size=128, seq_len=32, num_layers=2, num_heads=4, hidden=32, ffn=64)
    >>> PlainLM(cfg)(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 128])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainConfig", "PlainLM"]


@dataclass(frozen=True)
class PlainConfig:
    """Shape of a :class:`PlainLM`; ``hidden`` must be divisible by ``num_heads``."""

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    hidden: int
    ffn: int
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.num_heads:
            raise ValueError(f"PlainConfig.hidden ({self.hidden}) must be divisible by "
                             f"num_heads ({self.num_heads})")


def _maybe_dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class _Mix(nn.Module):
    """Causal multi-head attention written with matmul, a mask buffer and softmax."""

    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.heads, self.width = cfg.num_heads, cfg.hidden // cfg.num_heads
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.drop = _maybe_dropout(cfg.attn_dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, self.width).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.width))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = self.drop(torch.softmax(scores, dim=-1))
        return self.wo((probs @ v).permute(0, 2, 1, 3).reshape(b, t, c))


class _Ffn(nn.Module):
    """``w_out(relu(w_in(x))**2)`` (squared ReLU), with biases."""

    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.w_in = nn.Linear(cfg.hidden, cfg.ffn)
        self.w_out = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.relu(self.w_in(x)).square())


class _Layer(nn.Module):
    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, bias=False)
        self.mix = _Mix(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden, bias=False)
        self.ffn = _Ffn(cfg)
        self.drop = _maybe_dropout(cfg.resid_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.drop(self.mix(self.norm1(x)))
        return h + self.drop(self.ffn(self.norm2(h)))


class PlainLM(nn.Module):
    """``forward(idx[b, t]) -> logits[b, t, vocab_size]``; weights drawn normal(0, 0.02) in module order."""

    def __init__(self, cfg: PlainConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.hidden))
        self.h = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) for every matrix and the position table, zero biases, unit norms."""
        nn.init.normal_(self.pos, std=0.02)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        torch._assert(t <= self.cfg.seq_len, f"sequence length exceeds PlainConfig.seq_len={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos[:t]
        for layer in self.h:
            x = layer(x)
        return self.out(self.norm_out(x))
