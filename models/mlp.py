"""A plain multi-layer perceptron for small tests: ``Linear, ReLU, ..., Linear`` in ``layers``.

Module paths: ``layers.{2i}`` are the ``nn.Linear`` layers, ``layers.{2i+1}`` the ``nn.ReLU``
between them; the last Linear has no ReLU after it.

Example::

    >>> import torch
    >>> cfg = MLPConfig(in_features=8, hidden=16, num_layers=3, out_features=4)
    >>> MLP(cfg)(torch.zeros(2, 8)).shape
    torch.Size([2, 4])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MLPConfig", "MLP"]


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an :class:`MLP`: ``num_layers`` Linear layers, ``hidden`` wide between them."""

    in_features: int
    hidden: int
    num_layers: int
    out_features: int

    def __post_init__(self) -> None:
        for name in ("in_features", "hidden", "num_layers", "out_features"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")


class MLP(nn.Module):
    """``forward(x[..., in_features]) -> [..., out_features]``; torch's default Linear init."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        widths = [cfg.in_features] + [cfg.hidden] * (cfg.num_layers - 1) + [cfg.out_features]
        modules: list[nn.Module] = []
        for i in range(cfg.num_layers):
            modules.append(nn.Linear(widths[i], widths[i + 1]))
            if i < cfg.num_layers - 1:
                modules.append(nn.ReLU())
        self.layers = nn.Sequential(*modules)

    def reset_parameters(self) -> None:
        """Redraw every Linear as its constructor did (use after ``to_empty`` from meta)."""
        for module in self.layers:
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
