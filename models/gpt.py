"""A GPT-2 style decoder: learned positions, LayerNorm, fused-QKV attention, GELU MLP, tied head.

Written plainly so that ``torch.export.export(model, (idx,), strict=False)`` yields the aten ops the
sharding passes match: ``aten.linear`` for every projection, ``aten.split`` for the fused QKV,
``aten.view`` for the head reshapes and ``aten.scaled_dot_product_attention`` for attention.

Module paths (the names the tensor-parallel plan refers to)::

    tok_emb, pos_emb
    blocks.{i}.ln_1, blocks.{i}.attn.qkv, blocks.{i}.attn.proj
    blocks.{i}.ln_2, blocks.{i}.mlp.fc, blocks.{i}.mlp.proj
    ln_f, lm_head          (lm_head.weight is tok_emb.weight)

Example::

    >>> import torch
    >>> cfg = GPTConfig(vocab_size=128, seq_len=32, num_layers=2, num_heads=4, hidden=32)
    >>> GPT(cfg)(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 128])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPTAttention", "GPTMLP", "GPTBlock", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 style model; ``hidden`` must be divisible by ``num_heads``."""

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    hidden: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.num_heads


def _dropout(p: float) -> nn.Module:
    """A dropout module, or an identity when ``p == 0`` (no dropout node in the graph)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class GPTAttention(nn.Module):
    """Causal self-attention with one fused ``qkv`` projection and an output ``proj``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.hidden = cfg.hidden
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.resid_drop = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, self.hidden)
        return self.resid_drop(self.proj(y))


class GPTMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with the tanh approximation of GELU, as GPT-2."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.drop = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style language model: ``forward(idx[b, t]) -> logits[b, t, vocab_size]``.

    Weights are drawn as GPT-2 does (normal(0, 0.02); residual output projections scaled by
    ``1/sqrt(2 * num_layers)``; biases zero; norms one), so a model is reproducible from
    ``torch.manual_seed``. Built under ``torch.device("meta")`` it allocates nothing; after
    ``to_empty(device=...)`` call :meth:`tie_weights` (``to_empty`` unties) then
    :meth:`reset_parameters`, which draws exactly the weights a direct build draws under the
    same seed. The submodules are always constructed on meta first, so torch's default
    initialisation never runs and never consumes the RNG.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        device = torch.get_default_device()
        with torch.device("meta"):  # skip torch's default init; reset_parameters draws all
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
            self.drop = _dropout(cfg.dropout)
            self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Share ``tok_emb.weight`` as ``lm_head.weight``; redo after ``to_empty``."""
        self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every weight afresh from the global torch RNG, in module order (a no-op on meta)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.Linear) and module is not self.lm_head:
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        # torch._assert (not `if`): symbolic_trace can capture it, and eager still raises
        torch._assert(t <= self.cfg.seq_len,
                      f"sequence length exceeds GPTConfig.seq_len={self.cfg.seq_len}; "
                      "shorten the input or build the model with a larger seq_len")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
