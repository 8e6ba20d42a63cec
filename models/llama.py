"""A Llama style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

Written plainly so that ``torch.export.export(model, (idx,), strict=False)`` yields the aten ops the
sharding passes match: ``aten.linear`` for every projection (no biases), ``aten.view`` for the head
reshapes and ``aten.scaled_dot_product_attention`` for attention.

Module paths (the names the tensor-parallel plan refers to)::

    embed_tokens
    layers.{i}.input_layernorm
    layers.{i}.attn.q_proj, .k_proj, .v_proj, .o_proj, layers.{i}.attn.rotary (cos/sin buffers)
    layers.{i}.post_attention_layernorm
    layers.{i}.mlp.gate_proj, .up_proj, .down_proj
    norm, lm_head          (untied)

Each attention module owns its rotary ``cos``/``sin`` buffers, so a pipeline stage made of whole
layers needs nothing from another stage but the hidden state.

Meta device: building under ``torch.device("meta")`` allocates nothing, buffers included. After
``model.to_empty(device=...)`` the parameters and the (non-persistent) rotary buffers hold garbage;
call :meth:`Llama.reset_parameters` (which also calls :meth:`Llama.reset_buffers`), or only
``reset_buffers()`` before loading a state dict, since the buffers are not part of it.

Example::

    >>> import torch
    >>> cfg = LlamaConfig(vocab_size=128, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                   hidden=32, intermediate=64)
    >>> Llama(cfg)(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 128])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaBlock",
    "Llama",
    "rotate_half",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama style model; ``num_heads`` must be a multiple of ``num_kv_heads``."""

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden: int
    intermediate: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "num_kv_heads", "hidden",
                     "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden ({self.hidden}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig head_dim ({self.head_dim}) must be even for rotary embedding"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.num_heads


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, written out in plain ops."""

    def __init__(self, dim: int, *, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the gain back to one."""
        with torch.no_grad():
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (GPT-NeoX / HF Llama rotary style)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` tables of shape ``(seq_len, head_dim)``; ``forward(t)`` slices ``[:t]``."""

    def __init__(self, *, head_dim: int, seq_len: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.seq_len = seq_len
        self.theta = theta
        cos, sin = self._tables(device=None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, *, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the tables on ``device`` (default: the ambient one, so meta stays meta)."""
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                           / self.head_dim)
        )
        pos = torch.arange(self.seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the tables in place on the buffers' device (needed after ``to_empty``)."""
        cos, sin = self._tables(device=self.cos.device)
        self.cos.copy_(cos.to(self.cos.dtype))
        self.sin.copy_(sin.to(self.sin.dtype))

    def forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:t], self.sin[:t]


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(b, n_kv, t, hd) -> (b, n_kv * n_rep, t, hd)``, each kv head repeated ``n_rep`` times."""
    if n_rep == 1:
        return x
    b, n_kv, t, hd = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, n_rep, t, hd).reshape(b, n_kv * n_rep, t, hd)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with separate q/k/v/o projections and rotary positions."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.hidden = cfg.hidden
        kv_width = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.rotary = RotaryEmbedding(
            head_dim=cfg.head_dim, seq_len=cfg.seq_len, theta=cfg.rope_theta
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(t)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = self.num_heads // self.num_kv_heads
        k = _repeat_kv(k, n_rep)
        v = _repeat_kv(v, n_rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, self.hidden)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps)
        self.attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama style language model: ``forward(idx[b, t]) -> logits[b, t, vocab_size]``.

    Weights are drawn normal(0, 0.02), norms one, so a model is reproducible from
    ``torch.manual_seed``; ``to_empty`` + :meth:`reset_parameters` draws exactly the weights a
    direct build draws under the same seed. The submodules are always constructed on meta
    first, so torch's default initialisation never runs. See the module docstring for the
    meta-device recipe.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        device = torch.get_default_device()
        with torch.device("meta"):  # skip torch's default init; reset_parameters draws all
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every weight afresh from the global torch RNG and recompute the rotary buffers."""
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute every rotary ``cos``/``sin`` table (they are not saved in the state dict)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_buffers()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        # torch._assert (not `if`): symbolic_trace can capture it, and eager still raises
        torch._assert(t <= self.cfg.seq_len,
                      f"sequence length exceeds LlamaConfig.seq_len={self.cfg.seq_len}; "
                      "shorten the input or build the model with a larger seq_len")
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
