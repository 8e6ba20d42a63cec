"""Tensor-parallel coverage of 28 transformers families (autopar.models.hf.HF_RAW), planned in one process.

Each family is the library's own class from a small config of its own quirks, built on the meta
device and planned at tp=2 and tp=4 (``autopar.coverage_by_tp``: one capture, two lowerings; the
tp=2 plan's rank-0 graph is also read for Megatron's collectives per block). The share of the
elements of its >= 2-D weights that end up sharded must stay at or above the floor recorded here:
the 95% target where the family reaches it, else the share measured today (these floors only go
up). ``None``: the plan at that degree is refused today (none is, since kv heads fewer than tp are
replicated).
docs/coverage.md shows the same figures with what stays replicated (bench/coverage_families.py).
"""
from __future__ import annotations

import functools
import logging
from collections import Counter, defaultdict

import pytest

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.models.hf import HF_RAW, build_hf_raw, hf_raw_example  # noqa: E402

TARGET = 0.95
# family: (floor at tp=2, floor at tp=4)
FLOORS = {
    "llama": (TARGET, TARGET), "mistral": (TARGET, TARGET), "qwen2": (TARGET, TARGET), "qwen3": (TARGET, TARGET),
    "mixtral": (TARGET, TARGET), "phi3": (TARGET, TARGET), "gemma": (TARGET, TARGET), "gpt2": (TARGET, TARGET),
    "bert": (TARGET, TARGET), "gemma2": (TARGET, TARGET), "olmo2": (TARGET, TARGET), "gpt_neox": (TARGET, TARGET),
    "gptj": (TARGET, TARGET), "falcon": (TARGET, TARGET), "falcon_new": (TARGET, TARGET), "bloom": (TARGET, TARGET),
    "opt": (TARGET, TARGET), "gpt_bigcode": (TARGET, TARGET), "qwen2_moe": (TARGET, TARGET),
    "qwen3_moe": (TARGET, TARGET), "roberta": (TARGET, TARGET), "t5": (TARGET, TARGET), "bart": (TARGET, TARGET),
    "vit": (TARGET, TARGET), "clip_vision": (TARGET, TARGET), "swin": (TARGET, TARGET),
    # latent attention: the q and kv down-projections stay whole (6.4% of this small model's matrix weights)
    "deepseek_v3": (0.93, 0.93), "deepseek_v2": (0.93, 0.93),
}
REQUIRED = ("gpt2", "gpt_neox", "gptj", "falcon", "bloom", "opt", "phi3", "gemma2", "qwen3", "llama", "mistral",
            "mixtral", "bert", "vit")


def test_the_matrix_holds_the_issue_families_and_more():
    assert set(FLOORS) == set(HF_RAW) and set(REQUIRED) <= set(FLOORS) and len(FLOORS) >= 20
    kinds = {spec.inputs for spec in HF_RAW.values()}
    assert kinds == {"tokens", "images", "seq2seq"}  # decoders and encoders, vision, encoder-decoder


def test_every_family_plans_and_shards_at_least_its_floor():
    below = {}
    for name, floors in FLOORS.items():
        reports = _planned_families()[name][0]
        for (tp, report), floor in zip(reports.items(), floors):
            if floor is None:
                assert "not divisible by tp=4" in report.refused, (name, tp, report.share)
            elif report.refused or report.share < floor:
                below[(name, tp)] = (report.share, floor, report.refused[:120])
    assert not below, f"families below their floors (share, floor, refusal): {below}"


# Megatron's collectives per block at tp=2, read off rank 0's rewritten graph: (forward all-reduces g,
# backward all-reduces f) of each block in graph order. Two of each per block (attention, MLP) unless
# the table says: a parallel block (attention and MLP read one norm: GPT-J, Falcon) has one f; a
# decoder block with cross-attention (T5, BART) has a third g and a fourth f (the encoder output its
# keys and values read); Qwen2-MoE's shared expert adds a pair; a gathered column (Swin's
# downsample) adds an f and an all-gather; DeepSeek-V3's latent attention has an f for each up-projection
# (q and kv read different latents), its MoE block a pair for the routed and for the shared experts.
# Anything else per block would be a collective Megatron has not.
_PARALLEL_BLOCK = ((2, 1), (2, 1))
_SEQ2SEQ_BLOCKS = ((2, 2), (2, 2), (3, 4), (3, 4))
BLOCK_COLLECTIVES = {"gptj": _PARALLEL_BLOCK, "falcon": _PARALLEL_BLOCK, "qwen2_moe": ((3, 3), (3, 3)),
                     "t5": _SEQ2SEQ_BLOCKS, "bart": _SEQ2SEQ_BLOCKS, "swin": ((2, 3), (2, 2)),
                     "deepseek_v3": ((2, 3), (3, 4)), "deepseek_v2": ((2, 3), (3, 4))}
# the collectives a block may hold besides g and f: gradient sums of replicated parameters read on head
# shards (backward only), partial sums of norms over every head (OLMo 2), a gathered column's all-gather
_BLOCK_EXTRAS = {"TpGradSum", "TpGroupGradSum", "TpPartialSum", "TpGather"}


def test_every_family_holds_megatrons_collectives_per_block():
    wrong = {}
    for name in FLOORS:
        seen, extras = _block_collectives(_planned_families()[name][1])
        if seen != BLOCK_COLLECTIVES.get(name, ((2, 2), (2, 2))) or extras:
            wrong[name] = (seen, extras)
    assert not wrong, f"per block (g, f) and unexpected collectives: {wrong}"


def _block_collectives(units: dict) -> tuple[tuple, set]:
    """((g, f) per block in graph order, collectives a block holds beyond g, f and the allowed extras)."""
    blocks = [c for c in units.values() if c["TpReduce"] and c["TpCopy"]]  # embeddings, head: one each
    extras = set().union(*blocks) - {"TpReduce", "TpCopy"} - _BLOCK_EXTRAS
    return tuple((c["TpReduce"], c["TpCopy"]) for c in blocks), extras


@functools.lru_cache(maxsize=1)
def _planned_families() -> dict:
    """{family: ({tp: CoverageReport} at tp=2 and 4, {unit: Counter of collective classes} of rank 0's
    graph at tp=2)}: one capture per family serves both tests."""
    from autopar.ir.meta_keys import MODULE, get_meta
    from autopar.ops.collectives import collective_nodes
    logging.disable(logging.WARNING)  # the reports carry every reason the warnings would repeat
    try:
        out = {}
        for name in FLOORS:
            model = build_hf_raw(name, device="meta")
            inputs, loss_fn, target = hf_raw_example(name)
            result = autopar.plan(model, {"tp": 2}, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                  ranks=[0])
            gm = result.graph(0)
            units: dict[str, Counter] = defaultdict(Counter)
            for node in collective_nodes(gm):
                units[get_meta(node, MODULE).unit][type(gm.get_submodule(node.target)).__name__] += 1
            reports = autopar.coverage_by_tp(model, inputs, tps=(2, 4), loss_fn=loss_fn, example_target=target,
                                             planned=result)
            out[name] = (reports, dict(units))
        return out
    finally:
        logging.disable(logging.NOTSET)
