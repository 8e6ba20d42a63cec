"""Small-config ``transformers`` families for the tensor-parallel coverage tests, and their runners.

Each config keeps its family's quirks (fused qkv layouts, multi-query, ALiBi, partial rotary,
Conv1D, q/k norms per head and over all heads, soft-capping, fewer kv heads than tp, T5's relative position
tables); nothing is downloaded. A family of ``SEQ2SEQ`` is fed a dict batch (input_ids, decoder_input_ids). Use as
``Case(model="<family>", kind="tp_families:train", ...)``, judged against :func:`reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SEED = 1234
VOCAB = 128

_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0, use_cache=False)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                   bos_token_id=0, eos_token_id=0, use_cache=False)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                   rotary_dim=4, bos_token_id=0, eos_token_id=0, use_cache=False)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                                      bos_token_id=0, eos_token_id=0, use_cache=False)),
    "falcon_mq": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=False, bos_token_id=0, eos_token_id=0, use_cache=False)),
    "falcon_gqa": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bos_token_id=0, eos_token_id=0, use_cache=False)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(  # multi-query, c_attn [q | k | v] split
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, multi_query=True, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DEC, "num_key_value_heads": 2, "head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_DEC, "num_key_value_heads": 2, "head_dim": 8,
                                                     "sliding_window": 8, "pad_token_id": 0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_DEC, "num_key_value_heads": 2, "pad_token_id": 0}),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**_DEC, "rotary_pct": 0.5}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_DEC, "num_key_value_heads": 2, "sliding_window": 4}),
    # learned positions offset by 2, biases on every projection, dropout off
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                                pad_token_id=1, bos_token_id=0, eos_token_id=0, use_cache=False)),
    "llama_kv2": ("LlamaConfig", "LlamaForCausalLM", {**_DEC, "num_key_value_heads": 2}),
    "llama_kv1": ("LlamaConfig", "LlamaForCausalLM", {**_DEC, "num_key_value_heads": 1}),
    # q/k RMSNorms over every head's features (an all-reduced partial sum each), 2 kv heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**_DEC, "num_key_value_heads": 2, "pad_token_id": 1}),
    # encoder-decoder: relative position tables of (buckets, heads), each read by every block of its stack
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
        use_cache=False)),
}
SEQ2SEQ = {"t5"}  # fed a dict batch: input_ids and decoder_input_ids


def build_family(name: str, **overrides):
    """Family ``name`` of :data:`FAMILIES`, built on CPU under the tests' seed."""
    import transformers
    transformers.logging.set_verbosity_error()
    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(SEED)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**fields, **overrides}))


def logits_loss(output, target):
    """Cross entropy over the vocabulary, reading the ModelOutput's logits."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def example_batch(batch: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g)


def sharded_share(name: str, tp: int) -> tuple[float, list[str]]:
    """(share of the elements of >=2-D weights that the plan shards at ``tp``, the replicated ones)."""
    import autopar
    model = build_family(name)
    x, y = example_batch()
    result = autopar.plan(model, {"tp": tp}, example_inputs=(x,), loss_fn=logits_loss, example_target=y, ranks=[0])
    total = sharded = 0
    replicated = []
    for param_name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        total += p.numel()
        if param_name in result.plan.param_shards:
            sharded += p.numel()
        else:
            replicated.append(param_name)
    return sharded / total, replicated


def _batches(case):
    g = torch.Generator().manual_seed(99)

    def ids():
        return torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)

    if case.model in SEQ2SEQ:
        return [({"input_ids": ids(), "decoder_input_ids": ids()}, ids()) for _ in range(case.steps)]
    return [(ids(), ids()) for _ in range(case.steps)]


def _call(model, x):
    return model(**x) if isinstance(x, dict) else model(x)


def _optimizer(case):
    return lambda params: torch.optim.SGD(params, lr=case.lr, momentum=0.9)


def reference(case) -> dict:
    """One device: losses and the final state_dict."""
    model = build_family(case.model, **dict(case.overrides))
    opt = _optimizer(case)(list(model.parameters()))
    losses = []
    for x, y in _batches(case):
        opt.zero_grad()
        loss = logits_loss(_call(model, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(case, mesh) -> dict:
    """The family compiled on ``mesh``: this rank's losses, the full state and what the plan shards."""
    import autopar
    model = build_family(case.model, **dict(case.overrides))
    data = _batches(case)
    first = data[0][0]
    inputs = first if isinstance(first, dict) else (first,)
    options = dict(case.options)
    starts = dict(case.extra).get("stage_starts")
    if starts:  # where the pipeline cuts, as a user edits the Plan (T5: inside a stack, after its bias)
        plan = autopar.plan(build_family(case.model, **dict(case.overrides)), dict(zip(("dp", "pp", "tp"), case.mesh)),
                            example_inputs=inputs, loss_fn=logits_loss, example_target=data[0][1], ranks=[0]).plan
        options["plan"] = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"stage_starts": starts})})
    program = autopar.compile(model, mesh, example_inputs=inputs, loss_fn=logits_loss, example_target=data[0][1],
                              optimizer=_optimizer(case), p2p_timeout_s=120, **options)
    assert not starts or program.plan.pipeline.stage_starts == tuple(starts), program.plan.pipeline.stage_starts
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    return {"losses": losses, "state": program.full_state_dict(), "sharded": sorted(program.plan.param_shards)}
