"""Models nobody here wrote: Hugging Face ``transformers`` families, built from their config.

Weights are random (the config's own initialiser under ``torch.manual_seed``); nothing is
downloaded. Each model keeps its library class and parameter names, so its ``state_dict`` loads
into (and from) the library's own model as is; only ``forward`` is narrowed to
``forward(inputs) -> logits`` (no cache, no ``ModelOutput``), which is all a training graph needs.

Example::

    >>> import torch
    >>> from autopar.models.hf import build_hf_model
    >>> model = build_hf_model("hf_llama")
    >>> model(torch.randint(0, 128, (2, 8))).shape
    torch.Size([2, 8, 128])
    >>> type(model).__mro__[1].__name__
    'LlamaForCausalLM'

``transformers`` is an optional dependency (``pip install autopar[models]``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.errors import PlanError

__all__ = ["HF_MODELS", "HF_RAW", "HfSpec", "build_hf_model", "build_hf_raw", "hf_batch", "hf_model_names"]

log = logging.getLogger(__name__)

_VOCAB = 128
_IMAGE = 16  # side of the square images the vision models see
_NUM_LABELS = 10


@dataclass(frozen=True)
class HfSpec:
    """How to build one family: its config and model classes, config fields, and its input kind."""

    family: str
    config: str
    model: str
    fields: tuple
    inputs: str  # "tokens": (batch, seq) token ids; "images": (batch, 3, H, W) floats


_LM = dict(use_cache=False, tie_word_embeddings=True)
HF_MODELS: dict[str, HfSpec] = {
    "hf_gpt2": HfSpec("GPT-2", "GPT2Config", "GPT2LMHeadModel", tuple(dict(
        vocab_size=_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **_LM).items()), "tokens"),
    "hf_llama": HfSpec("Llama", "LlamaConfig", "LlamaForCausalLM", tuple(dict(
        vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, **_LM).items()), "tokens"),
    "hf_qwen2": HfSpec("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", tuple(dict(
        vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
        **_LM).items()), "tokens"),
    "hf_bert": HfSpec("BERT (encoder, masked LM)", "BertConfig", "BertForMaskedLM", tuple(dict(
        vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0).items()), "tokens"),
    "hf_resnet": HfSpec("ResNet (CNN, BatchNorm)", "ResNetConfig", "ResNetForImageClassification", tuple(dict(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=_NUM_LABELS).items()), "images"),
    "hf_convnext": HfSpec("ConvNeXt (CNN, LayerNorm)", "ConvNextConfig", "ConvNextForImageClassification",
                          tuple(dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=2,
                                     num_labels=_NUM_LABELS, drop_path_rate=0.0).items()), "images"),
}


_DECODER = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
# families as users hold them: the library's own classes with library defaults (use_cache=True, untied
# unless the family ties), each from a small config of its own; the model returns its ModelOutput
HF_RAW: dict[str, HfSpec] = {
    "llama": HfSpec("Llama", "LlamaConfig", "LlamaForCausalLM", tuple(_DECODER.items()), "tokens"),
    "mistral": HfSpec("Mistral", "MistralConfig", "MistralForCausalLM",
                      tuple({**_DECODER, "sliding_window": None}.items()), "tokens"),
    "qwen2": HfSpec("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", tuple(_DECODER.items()), "tokens"),
    "qwen3": HfSpec("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", tuple({**_DECODER, "head_dim": 8}.items()), "tokens"),
    "mixtral": HfSpec("Mixtral (mixture of experts)", "MixtralConfig", "MixtralForCausalLM", tuple(
        {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}.items()), "tokens"),
    "phi3": HfSpec("Phi-3 (fused qkv)", "Phi3Config", "Phi3ForCausalLM",
                   tuple({**_DECODER, "pad_token_id": 0}.items()), "tokens"),
    "gemma": HfSpec("Gemma", "GemmaConfig", "GemmaForCausalLM", tuple({**_DECODER, "head_dim": 8}.items()), "tokens"),
    "gpt2": HfSpec("GPT-2", "GPT2Config", "GPT2LMHeadModel", tuple(dict(
        vocab_size=_VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0).items()),
        "tokens"),
    "bert": HfSpec("BERT (encoder, masked LM)", "BertConfig", "BertForMaskedLM", tuple(dict(
        vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0).items()), "tokens"),
}


def build_hf_raw(name: str, *, device=None, **overrides) -> nn.Module:
    """Family ``name`` of :data:`HF_RAW` as the library builds it (its own class, forward and defaults).

    ``device``: build under ``torch.device(device)`` (``"meta"``: no weight allocated); ``overrides``
    go to the config (dropout, ``use_cache``, sizes).
    """
    if name not in HF_RAW:
        raise PlanError(f"unknown Hugging Face family {name!r}", where="autopar.models.hf.build_hf_raw",
                        fix=f"use one of {', '.join(HF_RAW)}")
    spec = HF_RAW[name]
    tf = _transformers()
    config = getattr(tf, spec.config)(**{**dict(spec.fields), **overrides})
    if device is None:
        return getattr(tf, spec.model)(config)
    with torch.device(device):
        return getattr(tf, spec.model)(config)


def hf_model_names() -> tuple[str, ...]:
    return tuple(HF_MODELS)


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PlanError("the Hugging Face models need the `transformers` package", where="autopar.models.hf",
                        fix="pip install 'autopar[models]' (or pip install transformers)") from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _logits_class(base: type) -> type:
    """A subclass of ``base`` whose forward returns the logits tensor (names and weights unchanged)."""

    def forward(self, inputs):
        """forward(inputs) -> logits: the library's forward without caches or output objects."""
        return base.forward(self, inputs)[0]

    return type(base.__name__ + "Logits", (base,), {"forward": forward, "__module__": __name__})


def build_hf_model(name: str, **overrides) -> nn.Module:
    """Family ``name`` (a key of :data:`HF_MODELS`) with random weights; ``overrides`` go to its config."""
    if name not in HF_MODELS:
        raise PlanError(f"unknown Hugging Face model {name!r}", where="autopar.models.hf.build_hf_model",
                        fix=f"use one of {', '.join(HF_MODELS)}")
    spec = HF_MODELS[name]
    tf = _transformers()
    fields = {**dict(spec.fields), **overrides}
    seq_len = fields.pop("seq_len", None)
    if seq_len is not None and spec.inputs == "tokens":
        key = "n_positions" if "n_positions" in fields else "max_position_embeddings"
        fields[key] = max(fields[key], seq_len)
    config = getattr(tf, spec.config)(**fields)
    model = _logits_class(getattr(tf, spec.model))(config)
    vocab = fields.get("vocab_size", fields.get("num_labels"))
    model.cfg = _Cfg(vocab_size=vocab, seq_len=seq_len or 16, inputs=spec.inputs)
    return model


@dataclass(frozen=True)
class _Cfg:
    """What the tests read off a model: ``vocab_size`` (classes for vision) and the input kind."""

    vocab_size: int
    seq_len: int
    inputs: str


def hf_batch(name: str, *, batch: int, seq: int, vocab: int, generator: torch.Generator):
    """One (inputs, targets) batch for family ``name``: token ids, or images and class labels."""
    if HF_MODELS[name].inputs == "images":
        images = torch.randn(batch, 3, _IMAGE, _IMAGE, generator=generator)
        return images, torch.randint(0, vocab, (batch,), generator=generator)
    return (torch.randint(0, vocab, (batch, seq), generator=generator),
            torch.randint(0, vocab, (batch, seq), generator=generator))

