"""Reference models the compiler is tested on: GPT-2 style, Llama style, a plain MLP, named presets,
and a small character-level text corpus built from the Python installation (no downloads).

Example::

    >>> import torch
    >>> from autopar.models import TextBatches, build_model, lm_loss
    >>> model = build_model("gpt_tiny")
    >>> inputs, targets = next(iter(TextBatches(seq_len=32, batch_size=2, seed=0)))
    >>> lm_loss(model(inputs), targets).shape
    torch.Size([])
"""
from autopar.models.corpus import CharTokenizer, TextBatches, corpus_text, lm_loss
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.presets import build_model, get_config, preset_names

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MLP",
    "MLPConfig",
    "build_model",
    "get_config",
    "preset_names",
    "CharTokenizer",
    "TextBatches",
    "corpus_text",
    "lm_loss",
]
