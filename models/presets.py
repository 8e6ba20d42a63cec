"""Named model configurations and :func:`build_model`, which builds one by name.

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     model = build_model("llama2_70b")
    >>> round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
    68.98
    >>> build_model("gpt_tiny", num_layers=1).cfg.num_layers
    1

The tiny presets use the vocabulary of :class:`~autopar.models.corpus.CharTokenizer`, so they train
on :class:`~autopar.models.corpus.TextBatches` directly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from autopar.errors import PlanError
from autopar.models.corpus import CharTokenizer
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.plain import PlainConfig, PlainLM

__all__ = [
    "gpt_tiny",
    "gpt2_small",
    "gpt2_medium",
    "gpt3_175b",
    "llama_tiny",
    "llama2_7b",
    "llama2_70b",
    "llama3_70b",
    "mlp_tiny",
    "plain_tiny",
    "get_config",
    "build_model",
    "preset_names",
]

ModelConfig = GPTConfig | LlamaConfig | MLPConfig | PlainConfig


def gpt_tiny() -> GPTConfig:
    """A 2-layer, 32-wide GPT over the character vocabulary, for fast tests."""
    return GPTConfig(vocab_size=CharTokenizer().vocab_size, seq_len=32, num_layers=2, num_heads=4,
                     hidden=32)


def gpt2_small() -> GPTConfig:
    """GPT-2 small: 124.4M parameters (the head is tied to the token embedding)."""
    return GPTConfig(vocab_size=50257, seq_len=1024, num_layers=12, num_heads=12, hidden=768)


def gpt2_medium() -> GPTConfig:
    """GPT-2 medium: 354.8M parameters."""
    return GPTConfig(vocab_size=50257, seq_len=1024, num_layers=24, num_heads=16, hidden=1024)


def gpt3_175b() -> GPTConfig:
    """GPT-3 175B (Brown et al., 2020): 96 layers, 96 heads, 12288 wide."""
    return GPTConfig(vocab_size=50257, seq_len=2048, num_layers=96, num_heads=96, hidden=12288)


def llama_tiny() -> LlamaConfig:
    """A 2-layer, 32-wide Llama with 2 kv heads for 4 query heads, over the character vocabulary."""
    return LlamaConfig(vocab_size=CharTokenizer().vocab_size, seq_len=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, hidden=32, intermediate=64)


def llama2_7b() -> LlamaConfig:
    """Llama 2 7B: 6.74B parameters, multi-head attention (32 kv heads)."""
    return LlamaConfig(vocab_size=32000, seq_len=4096, num_layers=32, num_heads=32,
                       num_kv_heads=32, hidden=4096, intermediate=11008)


def llama2_70b() -> LlamaConfig:
    """Llama 2 70B: 68.98B parameters, 8 kv heads."""
    return LlamaConfig(vocab_size=32000, seq_len=4096, num_layers=80, num_heads=64,
                       num_kv_heads=8, hidden=8192, intermediate=28672)


def llama3_70b() -> LlamaConfig:
    """Llama 3 70B: 70.55B parameters, 128256-token vocabulary, rope theta 500000."""
    return LlamaConfig(vocab_size=128256, seq_len=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, hidden=8192, intermediate=28672, rope_theta=500000.0)


def plain_tiny() -> PlainConfig:
    """A 2-layer, 32-wide decoder written unlike GPT and Llama (hand-written attention, see models/plain.py)."""
    return PlainConfig(vocab_size=CharTokenizer().vocab_size, seq_len=32, num_layers=2, num_heads=4,
                       hidden=32, ffn=64)


def mlp_tiny() -> MLPConfig:
    """A 3-layer, 32-wide MLP from 16 features to 8."""
    return MLPConfig(in_features=16, hidden=32, num_layers=3, out_features=8)


_PRESETS: tuple[tuple[str, Callable[[], ModelConfig]], ...] = (
    ("gpt_tiny", gpt_tiny),
    ("gpt2_small", gpt2_small),
    ("gpt2_medium", gpt2_medium),
    ("gpt3_175b", gpt3_175b),
    ("llama_tiny", llama_tiny),
    ("llama2_7b", llama2_7b),
    ("llama2_70b", llama2_70b),
    ("llama3_70b", llama3_70b),
    ("mlp_tiny", mlp_tiny),
    ("plain_tiny", plain_tiny),
)

_MODEL_OF_CONFIG: tuple[tuple[type, type[nn.Module]], ...] = (
    (GPTConfig, GPT),
    (LlamaConfig, Llama),
    (MLPConfig, MLP),
    (PlainConfig, PlainLM),
)


def preset_names() -> tuple[str, ...]:
    """The names :func:`build_model` accepts, in a fixed order."""
    return tuple(name for name, _ in _PRESETS)


def get_config(name: str, **overrides: object) -> ModelConfig:
    """The config of preset ``name`` with ``overrides`` applied (e.g. ``num_layers=4``)."""
    for preset, make in _PRESETS:
        if preset == name:
            cfg = make()
            break
    else:
        raise PlanError(
            f"unknown model preset {name!r}",
            where="autopar.models.build_model",
            fix=f"use one of {', '.join(preset_names())}",
        )
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise PlanError(
            f"preset {name!r} has no field(s) {', '.join(unknown)}",
            where="autopar.models.build_model",
            fix=f"override only {', '.join(sorted(fields))}",
        )
    return dataclasses.replace(cfg, **overrides)


def build_model(name: str, **overrides: object) -> nn.Module:
    """Build preset ``name`` with ``overrides`` on the ambient device (``torch.device("meta")``)."""
    cfg = get_config(name, **overrides)
    for config_type, model_type in _MODEL_OF_CONFIG:
        if isinstance(cfg, config_type):
            return model_type(cfg)
    raise AssertionError(f"no model class for {type(cfg).__name__}")
