"""The families whose sharding passes/tp/vocab_parallel.py, passes/tp/tp_gather_output.py and
passes/moe/tp_expert.py add train equal to one device: BERT's and RoBERTa's masked-LM heads (word
embeddings with padding_idx, a decoder
tied to them, the dense before the norm a column with a gathered output), ViT's patch convolution (gathered
on its channels), BART's head with its logits bias buffer, and Mixtral's and Qwen2-MoE's 3-D fused experts,
at tp=2 and at pp=2 x tp=2 (Mixtral also at tp=4); DeepSeek-V3's latent attention (its up-projections split by
head, the output projection by row, its low-rank down-projections and the rotary key every head shares whole)
with its routed and shared experts at tp=2, pp=2 x tp=2 and dp=2 x tp=2, V2's (its rotary as complex numbers)
at tp=2; each group of cases in one spawned process group (tests/equivalence.py). The batches hold the pad ids (0, 1): the padding rows'
lookups are exercised (their tied decoder rows do get gradients, on one device as here)."""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from case_marks import by_world  # noqa: E402
from equivalence import Case, assert_equivalent, run_cases  # noqa: E402
from hf_runners import hf_loop_reference, raw_reference  # noqa: E402

_NO_DROPOUT = (("hidden_dropout_prob", 0.0), ("attention_probs_dropout_prob", 0.0))  # the encoders' defaults are 0.1
_OVERRIDES = {"bert": _NO_DROPOUT, "roberta": _NO_DROPOUT, "mixtral": (("use_cache", False),),
              "qwen2_moe": (("use_cache", False),), "bart": (("dropout", 0.0), ("use_cache", False)),
              "deepseek_v3": (("use_cache", False),), "deepseek_v2": (("use_cache", False),)}
_TP2 = [Case(model=name, mesh=(1, 1, 2), kind="hf_runners:hf_train", overrides=_OVERRIDES[name])
        for name in ("bert", "roberta", "mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2")] + [
    Case(model="mixtral", mesh=(1, 1, 2), kind="hf_runners:hf_train", overrides=_OVERRIDES["mixtral"],
         options=(("sequence_parallel", True),))] + [  # the experts' f and g become the sequence-parallel ones
    # on their own batches (images and labels; a seq2seq dict): ViT's patch convolution column-sharded with
    # its output gathered, BART's logits bias buffer sliced per rank on the vocabulary-sharded logits, Swin's
    # patch-merging reduction and (its attention replicated) o_proj gathered
    Case(model=name, mesh=(1, 1, 2), kind="hf_runners:raw_train", steps=2, batch=4, seq=8,
         overrides=_OVERRIDES.get(name, ())) for name in ("vit", "bart", "swin")]
_PP2_TP2 = [Case(model=name, mesh=(1, 2, 2), kind="hf_runners:hf_train", overrides=_OVERRIDES[name])
            for name in ("bert", "mixtral", "deepseek_v3")] + [  # MoEs at tp=4 (2 kv heads shared) and dp=2 x tp=2
    Case(model="mixtral", mesh=(1, 1, 4), kind="hf_runners:hf_train", overrides=_OVERRIDES["mixtral"]),
    Case(model="deepseek_v3", mesh=(2, 1, 2), kind="hf_runners:hf_train", overrides=_OVERRIDES["deepseek_v3"])]
# what each family must have sharded (beyond its attention and MLP linears)
_SHARDED = {
    "bert": ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"),  # tied: the word embeddings
    "roberta": ("lm_head.decoder.weight", "lm_head.decoder.bias"),
    "mixtral": ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"),
    "qwen2_moe": ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                  "model.layers.0.mlp.shared_expert.down_proj.weight"),
    "vit": ("vit.embeddings.patch_embeddings.projection.weight", "vit.embeddings.patch_embeddings.projection.bias"),
    "swin": ("swin.encoder.layers.0.downsample.reduction.weight",),
    "bart": ("lm_head.weight",),  # tied (model.shared): both embeddings and the head, its bias buffer sliced
    **{name: tuple(f"model.layers.{i}.self_attn.{w}.weight" for i in (0, 1)
                   for w in ("q_b_proj", "kv_b_proj", "o_proj"))
       + ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj.weight")
       for name in ("deepseek_v3", "deepseek_v2")},
}
# what each family must keep whole: DeepSeek's low-rank down-projections (their up-projections split by head)
_WHOLE = {name: tuple(f"model.layers.{i}.self_attn.{w}.weight" for i in (0, 1)
                      for w in ("q_a_proj", "kv_a_proj_with_mqa"))
          for name in ("deepseek_v3", "deepseek_v2")}
# columns whose output must be all-gathered (passes/tp/tp_gather_output.py); Swin's o_proj is one too while its
# attention stays replicated (a row once that attention shards), so the check is for these at least
_GATHERED = {"bert": ["cls.predictions.transform.dense"], "roberta": ["lm_head.dense"],
             "vit": ["vit.embeddings.patch_embeddings.projection"],
             "swin": ["swin.embeddings.patch_embeddings.projection", "swin.encoder.layers.0.downsample.reduction"]}


@functools.lru_cache(maxsize=None)
def _results(world: int):
    cases = _TP2 if world == 2 else _PP2_TP2
    return dict(zip(cases, run_cases(cases)))


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(_TP2 + _PP2_TP2, ids=lambda c: c.name()))
def test_family_trains_equal_to_one_device(case):
    result = _results(case.world_size)[case]
    reference = raw_reference(case) if case.kind.endswith("raw_train") else hf_loop_reference(case)
    assert_equivalent(case, result, reference)
    missing = [n for n in _SHARDED[case.model] if n not in result["sharded"]]
    assert not missing, f"{case.model}: not sharded: {missing} (sharded: {result['sharded']})"
    split = [n for n in _WHOLE.get(case.model, ()) if n in result["sharded"]]
    assert not split, f"{case.model}: sharded, should stay whole: {split}"
    if "gathered" in result:
        assert set(_GATHERED.get(case.model, [])) <= set(result["gathered"]), result["gathered"]
        if case.model not in ("swin",):
            assert len(result["gathered"]) == len(_GATHERED.get(case.model, [])), result["gathered"]
