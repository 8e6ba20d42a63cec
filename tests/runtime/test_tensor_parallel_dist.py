"""Tensor parallelism end to end: training equivalence, dropout streams, activation memory.

One spawned group per world size runs every case of that size (see tests/equivalence.py).
- Equivalence with one device (fp32, rtol 1e-5) for tp 2 and 4, with and without sequence
  parallelism, on GPT (fused qkv, tied head), Llama (separate q/k/v, grouped-query kv) and
  PlainLM (hand-written attention, other names); pipeline x tp with a tied, vocabulary-sharded
  embedding/head on two stages; dp x tp; inference with the logits gathered.
- Dropout: replicated-region masks equal on every tp rank, sharded-region masks differ; with
  dropout only in replicated regions tp=2 still trains exactly like one device; tp=1 likewise.
- Activation memory per block per rank: with sequence parallelism every saved activation
  divides by tp; without it the norms' inputs and the column linears' input stay whole
  (Korthikanti et al. 2022, adapted to fp32 without dropout).
"""
from __future__ import annotations

import functools

import pytest
import torch

from case_marks import by_world
from equivalence import Case, assert_equivalent, assert_outputs_match, batches, build, reference_run, run_cases

pytestmark = pytest.mark.dist

SP = (("sequence_parallel", True),)
KV4 = (("num_kv_heads", 4),)  # tp=4 needs as many kv heads as ranks
MODELS = [("gpt_tiny", ()), ("llama_tiny", ()), ("plain_tiny", ())]
DROPOUT = (("resid_dropout", 0.1),)  # plain_tiny: dropout only where the values are replicated

TRAIN = (  # (tp=2 without SP on GPT and Llama: tests/runtime/test_equivalence.py)
    [Case(model=m, mesh=(1, 1, 2), options=o, overrides=ov) for m, ov in MODELS for o in ((), SP)
     if o or m == "plain_tiny"]
    + [Case(model=m, mesh=(1, 1, 4), options=o, overrides=ov + (KV4 if m == "llama_tiny" else ()))
       for m, ov in MODELS for o in ((), SP)]
    + [Case(model="gpt_tiny", mesh=(1, 2, 2), options=SP + (("schedule", "1f1b"),)),  # tied head on 2 stages
       Case(model="llama_tiny", mesh=(2, 1, 2), options=SP),
       Case(model="plain_tiny", mesh=(1, 1, 2), options=(("num_microbatches", 1),), overrides=DROPOUT),
       Case(model="plain_tiny", mesh=(1, 1, 1), options=(("num_microbatches", 1),),
            overrides=DROPOUT + (("attn_dropout", 0.1),))]
)
INFER = [Case(model="llama_tiny", mesh=(1, 2, 2), kind="infer", options=SP)]
MASKS = [Case(model="plain_tiny", mesh=(1, 1, 2), kind="tp_probes:dropout_masks_run", options=o,
              overrides=DROPOUT + (("attn_dropout", 0.2),)) for o in ((), SP)]
MEMORY_MODELS = [("gpt_tiny", ()), ("llama_tiny", KV4)]  # LayerNorm; RMSNorm written out
MEMORY = [Case(model=m, mesh=(1, 1, 2), kind="tp_probes:saved_bytes_run", options=(("num_microbatches", 1),) + o,
               overrides=ov) for m, ov in MEMORY_MODELS for o in ((), SP)]


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = [c for c in TRAIN + INFER + MASKS + MEMORY if c.world_size == world]
    return dict(zip(cases, run_cases(cases)))


def _result(case: Case) -> dict:
    result = _results(case.world_size)[case]
    assert "error" not in result, f"{case.name()} failed:\n{result.get('traceback', result['error'])}"
    return result


@pytest.mark.parametrize("case", by_world(TRAIN, ids=lambda c: c.name()))
def test_trains_like_one_device(case: Case):
    reference = reference_run(Case(model=case.model, overrides=case.overrides))
    assert_equivalent(case, _results(case.world_size)[case], reference)


@pytest.mark.parametrize("case", by_world(INFER, ids=lambda c: c.name()))
def test_inference_returns_the_gathered_logits(case: Case):
    assert_outputs_match(case, _result(case))  # every rank returns the gathered logits


@pytest.mark.parametrize("case", by_world(MASKS, ids=lambda c: c.name()))
def test_dropout_masks_match_where_replicated_and_differ_where_sharded(case: Case):
    result = _result(case)
    ranks = [r["masks"] for r in result["per_rank"]]
    sequence_parallel = dict(case.options).get("sequence_parallel", False)
    # attention probabilities are sharded on heads; the residual dropouts are sharded only under SP
    assert len(result["sharded"]) == (6 if sequence_parallel else 2)
    assert len(result["replicated"]) == (0 if sequence_parallel else 4)
    for name in result["replicated"]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    for name in result["sharded"]:
        assert ranks[0][name].shape == ranks[1][name].shape
        assert not torch.equal(ranks[0][name], ranks[1][name]), name
        assert ranks[0][name].any() and not ranks[0][name].all(), name  # a real mask


@functools.lru_cache(maxsize=None)
def _one_device_block_bytes(model_name: str, overrides: tuple) -> int:
    import autopar
    from autopar.models import lm_loss
    from tp_probes import saved_bytes_per_unit
    case = Case(model=model_name, overrides=overrides)
    model = build(case)
    idx, tgt = batches(case, model.cfg.vocab_size)[0]
    plan = autopar.plan(model, (1, 1, 1), example_inputs=(idx,), loss_fn=lm_loss, example_target=tgt,
                        num_microbatches=1)
    per_unit = saved_bytes_per_unit(plan.graph(0), [idx, tgt])
    return per_unit[_first_block(per_unit)]


def _first_block(per_unit: dict) -> str:
    return next(u for u in per_unit if u.endswith(".0"))


def _replicated_bytes(model_name: str, b: int, s: int, h: int) -> int:
    """What tensor parallelism alone keeps whole per block: the norms' saved tensors and the columns' input.

    LayerNorm saves its input and per-token mean and rstd; the written-out RMSNorm saves its input,
    the normalised value and the per-token rsqrt; each of the two column groups saves its input.
    """
    per_norm = b * s * h + 2 * b * s if model_name != "llama_tiny" else 2 * b * s * h + b * s
    return 4 * (2 * per_norm + 2 * b * s * h)


@pytest.mark.parametrize("model_name,overrides", MEMORY_MODELS, ids=[m for m, _ in MEMORY_MODELS])
def test_sequence_parallel_divides_every_block_activation_by_tp(model_name, overrides):
    tp = 2
    one = _one_device_block_bytes(model_name, overrides)
    tp_only, with_sp = [
        _result(Case(model=model_name, mesh=(1, 1, tp), kind="tp_probes:saved_bytes_run",
                     options=(("num_microbatches", 1),) + o, overrides=overrides))["saved_bytes"]
        for o in ((), SP)]
    cfg = build(Case(model=model_name, overrides=overrides)).cfg
    replicated = _replicated_bytes(model_name, Case().batch, Case().seq, cfg.hidden)
    for rank in range(tp):
        block = _first_block(tp_only[rank])
        # Korthikanti et al.: tensor parallelism divides all but the replicated stretch ...
        assert tp_only[rank][block] == replicated + (one - replicated) // tp
        # ... and sequence parallelism divides that too
        assert with_sp[rank][block] * tp == one
    assert with_sp[0][block] / tp_only[0][block] == pytest.approx(one / tp / (replicated + (one - replicated) / tp))
