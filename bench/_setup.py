"""What every benchmark builds the same way: the seeded model, its character batches, AdamW."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["adamw", "text_batches", "seeded_model"]


def adamw(params):
    """The benchmarks' optimizer (both contenders)."""
    return torch.optim.AdamW(params, lr=1e-3)


def text_batches(model: dict, *, batch: int, seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (tokens, targets) batches of ``batch`` sequences of ``model["seq_len"]`` characters."""
    from autopar.models import TextBatches
    it = iter(TextBatches(seq_len=model["seq_len"], batch_size=batch, seed=seed))
    return [next(it) for _ in range(count)]


def seeded_model(model: dict, *, seed: int) -> nn.Module:
    """``build_model(model["name"], **rest)`` after ``torch.manual_seed(seed)``: the same weights everywhere."""
    from autopar.models import build_model
    torch.manual_seed(seed)
    return build_model(model["name"], **{k: v for k, v in model.items() if k != "name"})
