"""transformers families for context parallelism's analyses, each from a small config of its own quirks.

Llama with grouped-query attention, Qwen3 (q/k norms), Mistral with a sliding window shorter than the
sequence, Gemma 2 (soft-capping, a sliding window on alternate layers), GPT-2 (Conv1D, learned positions),
Falcon with multi-query attention, BERT (bidirectional, a padding mask), Mixtral (experts), DeepSeek-V3
(multi-head latent attention, experts) and BLOOM (ALiBi). Each is captured on a dict batch
(``input_ids``, ``attention_mask`` with row 1 right-padded, ``labels``; the model's own loss) with
``attn_implementation`` "sdpa" and "eager" where the family has both. The sequence (24) differs from
every other size of these configs, so a dim of 24 is the sequence.
"""
from __future__ import annotations

import functools

import torch

from tp_families import FAMILIES as TP_FAMILIES
from tp_families import SEED, VOCAB

SEQ, BATCH, PADDED = 24, 2, 5  # row 1's last PADDED tokens are padding
_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0, use_cache=False)
_OWN = {
    "bert": ("BertConfig", "BertForMaskedLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_DEC, "num_key_value_heads": 2, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_DEC, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
        "n_shared_experts": 1}),
}
# family -> (tests/tp_families.py name or own config, overrides)
CP_FAMILIES = {
    "llama": ("llama_kv2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 4}),
    "gemma2": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 50.0}),
    "gpt2": ("gpt2", {}),
    "falcon_mq": ("falcon_mq", {}),
    "bert": ("bert", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "bloom": ("bloom", {}),
}
EAGER_ONLY = {"gemma2", "bloom"}  # transformers 5.25 refuses attn_implementation="sdpa" for them
CAPTURES = [(f, impl) for f in CP_FAMILIES for impl in ("eager", "sdpa") if not (impl == "sdpa" and f in EAGER_ONLY)]


def build(family: str, impl: str, **config):
    """The family, built on CPU under the tests' seed, with attention implementation ``impl``; ``config``: fields
    of its config a case changes (read when the model is built, as Mixtral's ``router_aux_loss_coef``)."""
    import transformers
    transformers.logging.set_verbosity_error()
    name, overrides = CP_FAMILIES[family]
    config_cls, model_cls, fields = TP_FAMILIES.get(name) or _OWN[name]
    torch.manual_seed(SEED)
    config = getattr(transformers, config_cls)(**{**fields, **overrides, **config, "attn_implementation": impl})
    return getattr(transformers, model_cls)(config)


def batch() -> dict:
    """``input_ids``, ``attention_mask`` (row 1 right-padded), ``labels`` (-100 on padding)."""
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - PADDED:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@functools.lru_cache(maxsize=None)
def captured(family: str, impl: str):
    """(model, the captured graph on :func:`batch`, the batch), once per test session."""
    from autopar.passes.frontend.capture import capture
    model, data = build(family, impl), batch()
    graph = capture(model, tuple(data.values()), keywords=tuple(data), own_loss=True)
    return model, graph, data
