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
import torch.nn.functional as F

from autopar.errors import PlanError

__all__ = ["HF_MODELS", "HF_RAW", "HfSpec", "build_hf_model", "build_hf_raw", "hf_batch", "hf_model_names",
           "hf_raw_example", "token_loss", "class_loss"]

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
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
_ENCODER = dict(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
# learned position tables stay replicated (as Megatron-LM keeps them): 16 rows, as a real model's table is
# a small share of its weights (BERT-base: 0.4%), not the third of a 2-layer, width-32 model's that 64 rows make
_POSITIONS = 16
_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=_IMAGE,
               patch_size=4, num_labels=_NUM_LABELS)


_LATENT = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=64, bos_token_id=0,
               eos_token_id=0)


def _raw(family: str, config: str, model: str, inputs: str = "tokens", **fields) -> HfSpec:
    return HfSpec(family, config, model, tuple(fields.items()), inputs)


# families as users hold them: the library's own classes with library defaults (use_cache=True, untied
# unless the family ties), each from a small config of its own quirks; the model returns its ModelOutput.
# inputs: "tokens" (batch, seq) ids, "images" (batch, 3, 16, 16) pixels, "seq2seq" a dict batch of
# input_ids and decoder_input_ids
HF_RAW: dict[str, HfSpec] = {
    "llama": _raw("Llama (GQA: 2 kv heads)", "LlamaConfig", "LlamaForCausalLM", **_DECODER),
    "mistral": _raw("Mistral", "MistralConfig", "MistralForCausalLM", **_DECODER, sliding_window=None),
    "qwen2": _raw("Qwen2 (qkv biases)", "Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
    "qwen3": _raw("Qwen3 (q/k norms per head)", "Qwen3Config", "Qwen3ForCausalLM", **_DECODER, head_dim=8),
    "mixtral": _raw("Mixtral (mixture of experts)", "MixtralConfig", "MixtralForCausalLM", **_DECODER,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "phi3": _raw("Phi-3 (fused qkv, fused gate_up)", "Phi3Config", "Phi3ForCausalLM", **_DECODER, pad_token_id=0),
    "gemma": _raw("Gemma", "GemmaConfig", "GemmaForCausalLM", **_DECODER, head_dim=8),
    "gpt2": _raw("GPT-2 (Conv1D, fused qkv)", "GPT2Config", "GPT2LMHeadModel", vocab_size=_VOCAB,
                 n_positions=_POSITIONS, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "bert": _raw("BERT (encoder, masked LM, tied decoder)", "BertConfig", "BertForMaskedLM", **_ENCODER,
                 max_position_embeddings=_POSITIONS, pad_token_id=0),
    "gemma2": _raw("Gemma 2 (soft-capping, sliding window)", "Gemma2Config", "Gemma2ForCausalLM", **_DECODER,
                   head_dim=8, sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "olmo2": _raw("OLMo 2 (q/k norms over all heads)", "Olmo2Config", "Olmo2ForCausalLM", **_DECODER, pad_token_id=1),
    "gpt_neox": _raw("GPT-NeoX (qkv interleaved per head, partial rotary)", "GPTNeoXConfig", "GPTNeoXForCausalLM",
                     vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5, bos_token_id=0,
                     eos_token_id=0),
    "gptj": _raw("GPT-J (parallel block, interleaved rotary)", "GPTJConfig", "GPTJForCausalLM", vocab_size=_VOCAB,
                 n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, bos_token_id=0, eos_token_id=0),
    "falcon": _raw("Falcon (multi-query, fused query_key_value)", "FalconConfig", "FalconForCausalLM",
                   vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                   new_decoder_architecture=False, parallel_attn=True, bias=False, bos_token_id=0, eos_token_id=0),
    "falcon_new": _raw("Falcon new architecture (grouped qkv per kv head)", "FalconConfig", "FalconForCausalLM",
                       vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                       new_decoder_architecture=True, bos_token_id=0, eos_token_id=0),
    "bloom": _raw("BLOOM (ALiBi, fused qkv per head)", "BloomConfig", "BloomForCausalLM", vocab_size=_VOCAB,
                  hidden_size=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "opt": _raw("OPT (learned positions, offset 2)", "OPTConfig", "OPTForCausalLM", vocab_size=_VOCAB, hidden_size=32,
                ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=_POSITIONS,
                word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0, eos_token_id=0),
    "gpt_bigcode": _raw("GPTBigCode (multi-query, fused c_attn)", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                        vocab_size=_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=_POSITIONS, multi_query=True,
                        bos_token_id=0, eos_token_id=0),
    "qwen2_moe": _raw("Qwen2-MoE (experts and a shared expert)", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      **_DECODER, **_MOE, shared_expert_intermediate_size=64),
    "qwen3_moe": _raw("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_DECODER, **_MOE, head_dim=8),
    "roberta": _raw("RoBERTa (positions from padding)", "RobertaConfig", "RobertaForMaskedLM", **_ENCODER,
                    max_position_embeddings=_POSITIONS + 2, pad_token_id=1),
    "t5": _raw("T5 (encoder-decoder, relative bias, gated)", "T5Config", "T5ForConditionalGeneration", "seq2seq",
               vocab_size=_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "bart": _raw("BART (encoder-decoder, learned positions)", "BartConfig", "BartForConditionalGeneration", "seq2seq",
                 vocab_size=_VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 max_position_embeddings=_POSITIONS, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                 decoder_start_token_id=2),
    # multi-head latent attention (q and kv down-projections of low rank, per-head up-projections, a rotary
    # key every head shares, keys built in place) and routed plus shared experts; layer 0 dense
    "deepseek_v3": _raw("DeepSeek-V3 (latent attention, routed and shared experts)", "DeepseekV3Config",
                        "DeepseekV3ForCausalLM", **_LATENT),
    # the same attention with its rotary part as complex numbers (view_as_complex), a grouped router
    "deepseek_v2": _raw("DeepSeek-V2 (latent attention, complex rotary)", "DeepseekV2Config", "DeepseekV2ForCausalLM",
                        **_LATENT),
    "vit": _raw("ViT (vision, classifier)", "ViTConfig", "ViTForImageClassification", "images", **_VISION),
    "clip_vision": _raw("CLIP vision tower (classifier)", "CLIPConfig", "CLIPForImageClassification", "images",
                        vision_config=_VISION, num_labels=_NUM_LABELS),
    "swin": _raw("Swin (windows, relative position bias)", "SwinConfig", "SwinForImageClassification", "images",
                 image_size=_IMAGE, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                 num_labels=_NUM_LABELS, drop_path_rate=0.0),
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


def token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the vocabulary, reading a ModelOutput's ``logits`` (batch, seq, vocab)."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def class_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the classes, reading a ModelOutput's ``logits`` (batch, classes)."""
    return F.cross_entropy(output.logits.float(), target)


def hf_raw_example(name: str, *, batch: int = 4, seq: int = 8, seed: int = 0):
    """(example_inputs, loss_fn, example_target) that train family ``name`` of :data:`HF_RAW`.

    Token ids avoid 0..2 (the families' pad, bos and eos ids); a ``seq2seq`` family gets a dict batch
    of ``input_ids`` and ``decoder_input_ids``; an ``images`` family (batch, 3, 16, 16) pixels and labels.
    """
    kind = HF_RAW[name].inputs
    g = torch.Generator().manual_seed(seed)
    if kind == "images":
        return ((torch.randn(batch, 3, _IMAGE, _IMAGE, generator=g),), class_loss,
                torch.randint(0, _NUM_LABELS, (batch,), generator=g))
    ids = torch.randint(3, _VOCAB, (batch, seq), generator=g)
    inputs = {"input_ids": ids, "decoder_input_ids": torch.randint(3, _VOCAB, (batch, seq), generator=g)} \
        if kind == "seq2seq" else (ids,)
    return inputs, token_loss, torch.randint(0, _VOCAB, (batch, seq), generator=g)


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

