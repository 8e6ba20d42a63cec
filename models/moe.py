"""Mixture-of-experts reference models in plain torch, and Hugging Face's MoE families at small sizes.

- :class:`MoeLM` with ``top_k=1`` and a softmax router is a Switch Transformer (Fedus et al. 2021);
  with ``top_k=2``, a sigmoid router and ``num_shared_experts=1`` it is DeepSeek-style (DeepSeekMoE /
  DeepSeek-V3: sigmoid scores, normalised top-k weights, one shared expert every token passes through).
  Its experts are one fused 3-D tensor per projection (``w_in`` [E, D, F], ``w_out`` [E, F, D]) that
  each (token, choice) row indexes by its expert id, the static-shape form (no data-dependent sizes)
  that ``torch.export`` captures; each layer returns the Switch load-balancing loss
  ``E * sum_e f_e * P_e`` (f: share of routed rows, P: mean router probability).
- :class:`LoopMoeLM` keeps its experts as a ``ModuleList`` and runs every expert on every token, weighted
  by the (zero off the top-k) gate: the plain loop over experts.
- :func:`build_hf_moe` builds ``transformers``' Mixtral and Qwen3-MoE at a small size.

The models' ``forward(idx)`` returns ``(logits, aux_loss)``; :func:`moe_loss` is the training loss.

Example::

    >>> import torch
    >>> from autopar.models.moe import MoeConfig, MoeLM, moe_loss
    >>> model = MoeLM(MoeConfig(top_k=1))
    >>> logits, aux = model(torch.randint(0, 64, (2, 8)))
    >>> logits.shape, aux.dim()
    (torch.Size([2, 8, 64]), 0)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import PlanError

__all__ = ["MoeConfig", "MoeLM", "LoopMoeLM", "moe_loss", "build_moe", "build_hf_moe", "MOE_MODELS",
           "AUX_LOSS_COEF"]

AUX_LOSS_COEF = 0.01


@dataclass(frozen=True)
class MoeConfig:
    vocab_size: int = 64
    dim: int = 32
    ffn: int = 64
    num_layers: int = 2
    num_experts: int = 4
    top_k: int = 1
    router: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    num_shared_experts: int = 0
    seq_len: int = 16


class FusedExperts(nn.Module):
    """E expert MLPs as two 3-D tensors; each row is run through the expert its id names."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(cfg.num_experts, cfg.dim, cfg.ffn) * cfg.dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(cfg.num_experts, cfg.ffn, cfg.dim) * cfg.ffn ** -0.5)

    def forward(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.bmm(rows.unsqueeze(1), self.w_in[ids]))
        return torch.bmm(h, self.w_out[ids]).squeeze(1)


class SharedExpert(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.ffn * cfg.num_shared_experts, bias=False)
        self.down = nn.Linear(cfg.ffn * cfg.num_shared_experts, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _route(router: nn.Linear, flat: torch.Tensor, cfg: MoeConfig):
    """(top-k weights, top-k ids, router probabilities) of every token."""
    logits = router(flat)
    probs = torch.softmax(logits, dim=-1) if cfg.router == "softmax" else torch.sigmoid(logits)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.top_k > 1 or cfg.router == "sigmoid":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids, probs


def _balance_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch's load-balancing loss: E * sum_e (share of routed rows to e) * (mean probability of e)."""
    rows = ids.reshape(-1, 1) == torch.arange(num_experts, device=ids.device)  # [rows, E] one-hot
    share = rows.float().mean(dim=0)
    mean_prob = (probs / probs.sum(dim=-1, keepdim=True)).mean(dim=0)
    return num_experts * (share * mean_prob).sum()


class MoeLayer(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = FusedExperts(cfg)
        self.shared = SharedExpert(cfg) if cfg.num_shared_experts else None

    def forward(self, x):
        cfg = self.cfg
        flat = x.reshape(-1, cfg.dim)
        weights, ids, probs = _route(self.router, flat, cfg)
        rows = flat.unsqueeze(1).expand(-1, cfg.top_k, -1).reshape(-1, cfg.dim)  # one row per (token, choice)
        out = self.experts(rows, ids.reshape(-1)) * weights.reshape(-1, 1)
        out = out.view(-1, cfg.top_k, cfg.dim).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x), _balance_loss(probs, ids, cfg.num_experts)


class Block(nn.Module):
    def __init__(self, cfg: MoeConfig, moe: nn.Module):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.mix = nn.Linear(cfg.dim, cfg.dim)  # a token-wise stand-in for attention
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.moe = moe

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        out, aux = self.moe(self.norm2(x))
        return x + out, aux


class MoeLM(nn.Module):
    """Embedding, blocks of (token mixing, MoE), LM head; forward(idx) -> (logits, summed aux loss)."""

    def __init__(self, cfg: MoeConfig, layer=MoeLayer):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, layer(cfg)) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        return self.head(self.norm(x)), aux


class LoopMoeLayer(nn.Module):
    """Experts as a ModuleList, each run on every token and weighted by its (top-k masked) gate."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.dim))
                                     for _ in range(cfg.num_experts))

    def forward(self, x):
        flat = x.reshape(-1, self.cfg.dim)
        weights, ids, probs = _route(self.router, flat, self.cfg)
        gate = torch.zeros_like(probs).scatter(1, ids, weights)  # [T, E], zero off the top-k
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out = out + gate[:, e:e + 1] * expert(flat)
        return out.view_as(x), _balance_loss(probs, ids, self.cfg.num_experts)


class LoopMoeLM(MoeLM):
    def __init__(self, cfg: MoeConfig):
        super().__init__(cfg, layer=LoopMoeLayer)


def moe_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy plus ``AUX_LOSS_COEF`` times the router's load-balancing loss."""
    logits, aux = output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) + AUX_LOSS_COEF * aux


MOE_MODELS = {
    "switch": dict(top_k=1, router="softmax"),
    "deepseek": dict(top_k=2, router="sigmoid", num_shared_experts=1),
    "loop_moe": dict(top_k=2, router="softmax"),
}


def build_moe(name: str, **overrides) -> nn.Module:
    """A plain-torch MoE model of :data:`MOE_MODELS` (``switch``, ``deepseek``, ``loop_moe``)."""
    if name not in MOE_MODELS:
        raise PlanError(f"unknown MoE model {name!r}", where="autopar.models.moe.build_moe",
                        fix=f"use one of {', '.join(MOE_MODELS)}")
    cfg = MoeConfig(**{**MOE_MODELS[name], **overrides})
    return (LoopMoeLM if name == "loop_moe" else MoeLM)(cfg)


_HF_MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True)),
}


def build_hf_moe(name: str, **overrides) -> nn.Module:
    """``transformers``' ``mixtral`` or ``qwen3_moe`` at a small size, its router loss on (``output_router_logits``)."""
    if name not in _HF_MOE:
        raise PlanError(f"unknown Hugging Face MoE family {name!r}", where="autopar.models.moe.build_hf_moe",
                        fix=f"use one of {', '.join(_HF_MOE)}")
    import transformers as tf
    tf.logging.set_verbosity_error()
    config_name, model_name, fields = _HF_MOE[name]
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                use_cache=False, output_router_logits=True, router_aux_loss_coef=AUX_LOSS_COEF)
    config = getattr(tf, config_name)(**{**base, **fields, **overrides})
    return getattr(tf, model_name)(config)
