"""Ready-made targets for ``autopar inspect MODULE:CALLABLE``: each builds a model and its example data.

Each callable takes no arguments and returns ``(model, (inputs,), loss_fn, targets)`` (one global
batch), or a bare model where its name says so; weights and data are seeded, and the global random
state is left as it was. Example::

    autopar inspect autopar.models.examples:gpt_tiny --mesh dp=1,pp=2,tp=2 --rank 0
    autopar inspect autopar.models.examples:llama2_70b_meta --mesh dp=1,pp=4,tp=1
    autopar inspect autopar.models.examples:gpt_tiny_model --mesh pp=2 --input-shape 8x32 --input-dtype long

    >>> model, (tokens,), loss_fn, targets = gpt_tiny()
    >>> tuple(tokens.shape), loss_fn(model(tokens), targets).item() > 0
    ((8, 32), True)
"""
from __future__ import annotations

import torch
from torch import nn

from autopar.models.corpus import lm_loss
from autopar.models.presets import build_model

__all__ = ["gpt_tiny", "gpt_tiny_model", "llama_tiny", "mlp_tiny_model", "llama2_7b_meta", "llama2_70b_meta",
           "lm_batch"]

BATCH = 8
SEQ_LEN = 32


def lm_batch(*, vocab_size: int, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random ``(tokens, targets)`` of shape (batch, seq_len) in [0, vocab_size), on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    targets = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    return tokens.to(device), targets.to(device)


def _seeded(name: str, seed: int = 0, **overrides) -> nn.Module:
    """Preset ``name`` built from ``seed`` without touching the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(name, **overrides)


def gpt_tiny():
    """A 2-layer, 32-wide GPT and a batch of 8 x 32 random tokens, with ``lm_loss``."""
    model = _seeded("gpt_tiny", seq_len=SEQ_LEN)
    tokens, targets = lm_batch(vocab_size=model.cfg.vocab_size)
    return model, (tokens,), lm_loss, targets


def gpt_tiny_model() -> nn.Module:
    """The bare tiny GPT (no example data): give ``--input-shape 8x32 --input-dtype long``."""
    return _seeded("gpt_tiny", seq_len=SEQ_LEN)


def llama_tiny():
    """A 2-layer, 32-wide Llama (4 query heads, 2 kv heads) and a batch of 8 x 32 random tokens."""
    model = _seeded("llama_tiny", seq_len=SEQ_LEN)
    tokens, targets = lm_batch(vocab_size=model.cfg.vocab_size)
    return model, (tokens,), lm_loss, targets


def mlp_tiny_model() -> nn.Module:
    """The bare 3-layer MLP (16 features in): give ``--input-shape 8x16 --input-dtype float``."""
    return _seeded("mlp_tiny")


def llama2_7b_meta():
    """Llama 2 7B's shape on the meta device, with rotary tables for 65,536 positions (long-context training),
    and a meta batch of one 2,048-token sequence: ``autopar plan ... --max-seq`` reads how long it may grow."""
    with torch.device("meta"):
        model = build_model("llama2_7b", seq_len=65536)
    tokens, targets = lm_batch(vocab_size=model.cfg.vocab_size, batch=1, seq_len=2048, device="meta")
    return model, (tokens,), lm_loss, targets


def llama2_70b_meta():
    """Llama 2 70B on the meta device (no weights allocated) with a meta batch of 8 x 128 tokens.

    Planning exports about 4,900 nodes, which takes tens of seconds per tensor-parallel rank
    (``autopar.plan`` lowers each tp rank separately); symbolic_trace cannot capture this Llama.
    """
    with torch.device("meta"):
        model = build_model("llama2_70b")
    tokens, targets = lm_batch(vocab_size=model.cfg.vocab_size, seq_len=128, device="meta")
    return model, (tokens,), lm_loss, targets
