"""Context parallelism's attention ops against one device (ops/context_parallel/ring.py, ulysses.py).

Every case of tests/cp_runners.py (causal or not, padding, sliding windows, GQA and MQA, packed
documents, ALiBi, a learned bias, soft-capping, the load-balanced and the contiguous layout, value
dims other than the key dims) runs through ring attention and all-to-all attention on cp ranks
spawned with gloo, all in one group per world size; each rank's output shard and its dq, dk, dv (and
a learned bias's gradient) equal the whole sequence's eager attention and SDPA (fp32, relative 1e-5).
cp=2 runs by default; cp=4 is ``slow`` (tests/case_marks.py).
"""
from __future__ import annotations

import functools

import pytest

from case_marks import by_world
from cp_runners import CASES
from equivalence import Case, run_cases

WORLDS = [2, 4]


@functools.lru_cache(maxsize=None)
def _group(world: int) -> dict:
    cases = [Case(mesh=(1, 1, world), kind="cp_runners:attention_cases"),
             Case(mesh=(1, 1, world), kind="cp_runners:balance_cases")]
    results = run_cases(cases, timeout_s=900)
    for case, result in zip(cases, results):
        assert "error" not in result, f"{case.kind} at cp={world}:\n{result.get('traceback', result['error'])}"
    return {"attention": results[0], "balance": results[1]}


@pytest.mark.dist
@pytest.mark.parametrize("world", by_world(WORLDS, world_of=lambda w: w))
def test_every_case_equals_one_device_on_every_rank(world):
    result = _group(world)["attention"]
    assert len(result["rank_results"]) == world
    expected = {f"{c.name}/{s}" for c in CASES for s in c.strategies}
    for rank_result in result["rank_results"]:
        assert set(rank_result["problems"]) == expected
        bad = {name: p for name, p in rank_result["problems"].items() if p is not None}
        assert not bad, f"cp={world} rank {rank_result['rank']}: " + "; ".join(f"{n}: {p}" for n, p in bad.items())


@pytest.mark.dist
@pytest.mark.parametrize("world", by_world(WORLDS, world_of=lambda w: w))
def test_causal_ring_skips_future_blocks_and_balances_the_ranks(world):
    """Load-balanced: every rank computes the same number of sub-blocks, fewer than all of them; contiguous:
    rank r computes r + 1 blocks (the ring skips every block of keys after its queries)."""
    blocks = _group(world)["balance"]["blocks"]
    assert blocks[True] == [2 * world + 1] * world  # its own 2 chunks (3 blocks), then 2 blocks per other rank
    assert blocks[False] == [r + 1 for r in range(world)]
