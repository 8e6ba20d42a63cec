"""Context parallelism trains like one device (the shared harness judges every rank and every replica).

The sequence is cut over a cp mesh dim (passes/context_parallel/cp_shard.py, runtime/execution/cp_batch.py);
each case is judged on losses and every parameter after 3 steps, fp32 relative 1e-5. One spawned process group
per world size runs all of that size's cases.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch

from case_marks import by_world  # noqa: E402
from equivalence import Case, assert_equivalent, assert_outputs_match, reference_run, run_cases

pytestmark = pytest.mark.dist

TRAIN = [
    Case(model="gpt_tiny", cp=2),  # cp_strategy auto: all-to-all (4 heads)
    Case(model="gpt_tiny", cp=2, options=(("cp_strategy", "ring"),)),
    Case(model="gpt_tiny", cp=2, options=(("cp_strategy", "ring"), ("cp_load_balanced", False))),
    Case(model="gpt_tiny", cp=2, extra=(("padded_targets", True),)),  # the token count over cp
    Case(model="gpt_tiny", cp=2, options=(("zero_stage", 3),)),  # parameters sharded over dp x cp
    Case(model="gpt_tiny", cp=2, options=(("zero_stage", 2),)),
    Case(model="gpt_tiny", cp=2, options=(("recompute", "full"),)),
    Case(model="llama_tiny", cp=2),  # rotary positions, grouped-query attention (4 heads, 2 kv)
    # 4 ranks (slow): cp=4, and cp with each other axis
    Case(model="gpt_tiny", cp=4, options=(("cp_strategy", "ring"),)),
    Case(model="gpt_tiny", cp=4),
    Case(model="gpt_tiny", mesh=(2, 1, 1), cp=2, extra=(("padded_targets", True),)),
    Case(model="gpt_tiny", mesh=(1, 1, 2), cp=2),
    Case(model="gpt_tiny", mesh=(1, 1, 2), cp=2, options=(("sequence_parallel", True),)),
    Case(model="gpt_tiny", mesh=(1, 2, 1), cp=2, options=(("schedule", "1f1b"),)),
    Case(model="llama_tiny", mesh=(2, 1, 1), cp=2, options=(("zero_stage", 3),)),
]
INFER = [Case(model="gpt_tiny", cp=2, kind="infer")]


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    cases = [c for c in TRAIN + INFER if c.world_size == world]
    return dict(zip(cases, run_cases(cases)))


@pytest.mark.parametrize("case", by_world(TRAIN, ids=lambda c: c.name(), slow_worlds=(4, 8)))
def test_cp_matches_single_device(case: Case):
    result = _results(case.world_size)[case]
    assert_equivalent(case, result, reference_run(Case(model=case.model, extra=case.extra)))
    if case.mesh[2] > 1:  # the cp attention node shards over tp on its heads, as SDPA does
        shards = json.loads(result["plan"])["param_shards"]
        assert "blocks.0.attn.qkv.weight" in shards and "blocks.0.attn.proj.weight" in shards, sorted(shards)


@pytest.mark.parametrize("case", by_world(INFER, ids=lambda c: c.name(), slow_worlds=(4, 8)))
def test_cp_forward_returns_the_whole_sequence(case: Case):
    assert_outputs_match(case, _results(case.world_size)[case])


# transformers families (tests/cp_families.py) on dict batches with their own loss, and on tensors with a loss_fn
_FAM = "cp_family_runners:cp_train"
_OWN, _FN, _SP = (), (("loss", "loss_fn"),), "sequence_parallel"


def _matrix(family: str, cp4: tuple, dp: tuple, tp: tuple, pp: tuple, *, impl: str | None = None) -> list[Case]:
    """``family`` at cp=4 (seq 32), dp=2 x cp=2, cp=2 x tp=2 and pp=2 x cp=2 (seq 24): each mesh's
    (cp_strategy, loss extra[, "sequence_parallel" | a schedule])."""
    extra = (("impl", impl),) if impl else ()
    out = []
    for mesh, cp, seq, (strategy, loss, *more) in (((1, 1, 1), 4, 32, cp4), ((2, 1, 1), 2, 24, dp),
                                                   ((1, 1, 2), 2, 24, tp), ((1, 2, 1), 2, 24, pp)):
        options = (("cp_strategy", strategy),) + tuple(
            ("sequence_parallel", True) if m == _SP else ("schedule", m) for m in more)
        out.append(Case(model=family, mesh=mesh, cp=cp, kind=_FAM, seq=seq, batch=4, options=options,
                        extra=extra + loss))
    return out


FAMILIES = [
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4),  # GQA (4 heads, 2 kv), own loss (labels shifted inside)
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4, extra=(("loss", "loss_fn"),)),
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4, extra=(("impl", "eager"),)),
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4, options=(("cp_strategy", "ring"),)),
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4, extra=(("packed", True),)),  # documents by position_ids
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4, extra=(("packed", True),),
         options=(("cp_strategy", "ring"),)),
    Case(model="llama", cp=2, kind=_FAM, seq=24, batch=4, options=(("zero_stage", 3), ("recompute", "full"))),
    # the other families at cp=2, each on its own quirk
    Case(model="qwen3", cp=2, kind=_FAM, seq=24, batch=4),  # q/k norms
    Case(model="mistral", cp=2, kind=_FAM, seq=24, batch=4, options=(("cp_strategy", "ring"),)),  # window 4 < 24
    Case(model="gemma2", cp=2, kind=_FAM, seq=24, batch=4, extra=(("impl", "eager"),)),  # soft-cap, windows
    Case(model="gpt2", cp=2, kind=_FAM, seq=24, batch=4),  # learned positions, Conv1D
    Case(model="falcon_mq", cp=2, kind=_FAM, seq=24, batch=4, options=(("cp_strategy", "ring"),)),  # one kv head
    Case(model="bert", cp=2, kind=_FAM, seq=24, batch=4),  # bidirectional, padding mask, masked-LM loss
    Case(model="mixtral", cp=2, kind=_FAM, seq=24, batch=4),  # experts (rowwise on the shard)
    Case(model="mean_pooled", cp=2, kind="cp_family_runners:pooled_train", seq=16, batch=4),  # a mean over the sequence
    # 4 ranks (slow): Llama at cp=4 and cp with every other axis
    Case(model="llama", cp=4, kind=_FAM, seq=32, batch=4),
    Case(model="llama", cp=4, kind=_FAM, seq=32, batch=4, options=(("cp_strategy", "ring"),)),
    Case(model="llama", mesh=(2, 1, 1), cp=2, kind=_FAM, seq=24, batch=4),
    Case(model="llama", mesh=(1, 1, 2), cp=2, kind=_FAM, seq=24, batch=4, extra=(("loss", "loss_fn"),)),
    Case(model="llama", mesh=(1, 2, 1), cp=2, kind=_FAM, seq=24, batch=4, options=(("schedule", "1f1b"),)),
    # 4 ranks (slow): every other family at cp=4, dp=2 x cp=2, cp=2 x tp=2 and pp=2 x cp=2 (issue 36's matrix);
    # on every mesh both strategies and both losses (own loss on dict batches, a loss_fn on tensors) meet
    *_matrix("qwen3", ("all_to_all", _OWN), ("ring", _FN), ("all_to_all", _OWN, _SP), ("ring", _FN, "gpipe")),
    *_matrix("mistral", ("ring", _FN), ("all_to_all", _OWN), ("ring", _FN), ("all_to_all", _OWN, "1f1b")),
    *_matrix("gemma2", ("ring", _OWN), ("all_to_all", _FN), ("ring", _OWN, _SP), ("all_to_all", _FN, "zb_h1"),
             impl="eager"),
    *_matrix("gpt2", ("all_to_all", _FN), ("ring", _OWN), ("all_to_all", _FN, _SP), ("ring", _OWN, "gpipe")),
    *_matrix("falcon_mq", ("all_to_all", _OWN), ("ring", _FN), ("ring", _OWN), ("all_to_all", _FN, "1f1b")),
    *_matrix("bert", ("ring", _FN), ("all_to_all", _OWN), ("all_to_all", _FN, _SP),
             ("ring", _OWN, "interleaved_1f1b")),
    *_matrix("mixtral", ("all_to_all", _OWN), ("ring", _FN), ("ring", _OWN), ("all_to_all", _FN, "gpipe")),
]
FAMILY_INFER = [Case(model="llama", cp=2, kind="cp_family_runners:cp_forward", seq=24, batch=4)]


@functools.lru_cache(maxsize=None)
def _family_results(world: int) -> dict:
    cases = [c for c in FAMILIES + FAMILY_INFER if c.world_size == world]
    return dict(zip(cases, run_cases(cases, timeout_s=60 * len(cases))))  # a hang guard (~5-10 s a case here)


@pytest.mark.parametrize("case", by_world(FAMILIES, ids=lambda c: c.name(), slow_worlds=(4, 8)))
def test_cp_family_matches_single_device(case: Case):
    from cp_family_runners import cp_reference, cut_without_cp, pooled_reference
    reference = pooled_reference(case) if case.model == "mean_pooled" else cp_reference(case)
    result = _family_results(case.world_size)[case]
    assert_equivalent(case, result, reference)
    plan = json.loads(result["plan"]) if "plan" in result else {}
    if case.mesh[2] > 1:  # the cp attention node shards over tp on its heads: the attention's projections are cut
        assert any("attn" in p or "attention" in p for p in plan["param_shards"]), sorted(plan["param_shards"])
    if case.mesh[1] > 1:  # the stages cut on the rank's FLOPs (its attention node counted) as without cp
        assert tuple(plan["pipeline"]["stage_starts"]) == cut_without_cp(case), plan["pipeline"]


@pytest.mark.parametrize("case", by_world(FAMILY_INFER, ids=lambda c: c.name(), slow_worlds=(4, 8)))
def test_cp_family_forward_returns_the_eager_logits(case: Case):
    from cp_family_runners import cp_forward_reference
    result = _family_results(case.world_size)[case]
    assert "error" not in result, result.get("traceback", result.get("error"))
    for rank, mine in enumerate(result["rank_results"]):
        for got, want in zip(mine["outputs"], cp_forward_reference(case), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")
