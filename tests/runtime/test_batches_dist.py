"""Batches as a user's loader makes them train equal to one device (docs/batches.md).

- transformers' Llama, GPT-2 and BERT on batches collated to a different length every step (17, 32, 9,
  24 tokens; labels -100 on the padding) on dp=2, pp=2, tp=2 (and pp=2 x tp=2, slow): one symbolic
  recapture at the first new length, none after (``built``);
- an epoch's last batch of 6 rows after batches of 8 on dp=2 and pp=2, on the model's own loss
  (token counts), a token-mean ``loss_fn`` and a mean-squared error (rows weigh), with a dp rank
  holding fewer rows than the other (5 rows over dp=2);
- a step autopar refuses (a length past the bound; one sequence parallelism cannot split; no rows
  left for a dp rank) raises autopar's error on every rank, and no rank steps.

Each group of cases runs in one spawned process group (tests/equivalence.py).
"""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from batch_runners import hf_reference, lm_reference, mse_reference  # noqa: E402
from case_marks import by_world  # noqa: E402
from equivalence import Case, assert_equivalent, run_cases  # noqa: E402

LENGTHS = (("lengths", (17, 32, 9, 24)),)
_OVERRIDES = {  # no dropout (one device draws other masks), and positions for 32 tokens
    "llama": (),
    "gpt2": (("n_positions", 64), ("resid_pdrop", 0.0), ("embd_pdrop", 0.0), ("attn_pdrop", 0.0)),
    "bert": (("max_position_embeddings", 64), ("hidden_dropout_prob", 0.0), ("attention_probs_dropout_prob", 0.0)),
}
_MESHES = ((2, 1, 1), (1, 2, 1), (1, 1, 2))
LENGTH_CASES = [Case(model=name, mesh=mesh, kind="batch_runners:hf_train", steps=4, overrides=_OVERRIDES[name],
                     extra=LENGTHS) for name in _OVERRIDES for mesh in _MESHES + ((1, 2, 2),)]
LENGTH_CASES += [  # the sequence symbolic from the start, and under sequence parallelism (lengths of even size)
    Case(model="llama", mesh=(1, 2, 1), kind="batch_runners:hf_train", steps=4, extra=LENGTHS,
         options=(("dynamic_shapes", "seq"),)),
    Case(model="llama", mesh=(1, 1, 2), kind="batch_runners:hf_train", steps=4,
         extra=(("lengths", (18, 32, 10, 24)),), options=(("sequence_parallel", True),)),
]
LAST = (("lengths", (16, 16, 16, 16)), ("rows", (8, 8, 8, 6)))
UNEVEN = (("lengths", (16, 16, 16)), ("rows", (8, 8, 5)))
PARTIAL_CASES = [Case(model=model, mesh=mesh, kind=f"batch_runners:{kind}", steps=4 if extra is LAST else 3,
                      overrides=_OVERRIDES.get(model, ()), extra=extra)
                 for model, kind in (("llama", "hf_train"), ("gpt_tiny", "lm_train"), ("mlp", "mse_train"))
                 for mesh, extra in (((2, 1, 1), LAST), ((1, 2, 1), LAST), ((2, 1, 1), UNEVEN))]
_REFERENCES = {"hf_train": hf_reference, "lm_train": lm_reference, "mse_train": mse_reference}


@functools.lru_cache(maxsize=None)
def _results(group: str, world: int):
    cases = [c for c in (LENGTH_CASES if group == "lengths" else PARTIAL_CASES) if c.world_size == world]
    return dict(zip(cases, run_cases(cases, timeout_s=1500)))


def _reference(case):
    return _REFERENCES[case.kind.partition(":")[2]](case)


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(LENGTH_CASES, ids=lambda c: c.name()))
def test_a_length_per_step_trains_equal_to_one_device(case):
    result = _results("lengths", case.world_size)[case]
    assert_equivalent(case, result, _reference(case))
    for mine in result["rank_results"]:  # the first new length recaptures once, symbolic; the rest reuse it
        assert mine["built"] == (0 if dict(case.options).get("dynamic_shapes") == "seq" else 1), mine["built"]
        assert [d.split(":")[0] for d in mine["dynamic_dims"]] == ["seq (dim 1 of input_ids, attention_mask, labels)"]


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(PARTIAL_CASES, ids=lambda c: c.name()))
def test_a_partial_batch_trains_equal_to_one_device_on_the_same_rows(case):
    result = _results("partial", case.world_size)[case]
    assert_equivalent(case, result, _reference(case))


# (mesh, options, the two steps' (rows, length), the error every rank raises: kind, what, fix)
REFUSALS = [
    ((2, 1, 1), (), ((8, 16), (8, 80)), ("InputError", "holds 80 tokens on dim 1 (seq), past the bound 64",
                                         "max_length=64")),
    ((2, 1, 1), (), ((8, 16), (1, 16)), ("PlanError", "no rows", "drop_last=True")),
    ((1, 2, 1), (), ((8, 16), (1, 16)), ("PlanError", "a batch of 1 rows makes 1 microbatches", "drop_last=True")),
    ((1, 1, 2), (("sequence_parallel", True),), ((8, 16), (8, 17)),
     ("InputError", "17 does not divide", "pad_to_multiple_of=2")),
]
REFUSAL_CASES = [Case(model="llama", mesh=mesh, options=options, kind="batch_runners:refused", steps=2,
                      extra=(("rows", tuple(r for r, _ in steps)), ("lengths", tuple(n for _, n in steps))))
                 for mesh, options, steps, _ in REFUSALS]


@functools.lru_cache(maxsize=None)
def _refusals():
    return dict(zip(REFUSAL_CASES, run_cases(REFUSAL_CASES, timeout_s=900)))


@pytest.mark.dist
@pytest.mark.parametrize("index", range(len(REFUSALS)), ids=lambda i: REFUSAL_CASES[i].name())
def test_a_refused_step_is_autopars_error_on_every_rank_and_nothing_steps(index):
    result = _refusals()[REFUSAL_CASES[index]]
    assert "error" not in result, result.get("traceback", result.get("error"))
    kind, what, fix = REFUSALS[index][3]
    for rank, mine in enumerate(result["rank_results"]):
        assert mine["step_count"] == 1, (rank, mine)
        assert mine["kind"] is not None, f"rank {rank} ran the step"
        if "refused its batch" in mine["what"]:  # a peer's refusal, named: the fix points at its error
            assert mine["kind"] == "PlanError" and "see the error dp rank" in mine["fix"], mine
            continue
        assert mine["kind"] == kind and what in mine["what"] and fix in mine["fix"], (rank, mine)
