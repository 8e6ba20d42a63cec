"""passes/tp/tp_random.py, ops/tp_rng.py: sharded-region random ops on a per-rank stream."""
from __future__ import annotations

import torch

from autopar.ir.meta_keys import MODULE, get_meta
from autopar.ops.tp_rng import TP_RNG_OFFSET, ShardedRandom, TpRngTracker, tp_rng_seed

from graph_runner import planned

DROPOUT = (("attn_dropout", 0.1), ("resid_dropout", 0.1))


def test_fork_leaves_the_default_stream_untouched_and_continues_its_own():
    torch.manual_seed(0)
    tracker = TpRngTracker(seed=5)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():
        b = torch.rand(8)
    assert not torch.equal(a, b)  # the stream goes on rather than repeating
    with TpRngTracker(seed=5).fork():
        assert torch.equal(torch.rand(8), a)
    with TpRngTracker(seed=6).fork():
        assert not torch.equal(torch.rand(8), a)


def test_seeds_differ_per_tp_rank():
    assert tp_rng_seed(1234, 0) == 1234 + TP_RNG_OFFSET
    assert tp_rng_seed(1234, 1) == tp_rng_seed(1234, 0) + 1


def _randoms(gm):
    return [gm.get_submodule(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), ShardedRandom)]


def test_attention_dropout_is_sharded_and_residual_dropout_replicated():
    _, _, _, result = planned("plain_tiny", tp=2, overrides=DROPOUT, options=(("vocab_parallel", True),))
    trackers = []
    for t in range(2):
        gm = result.graph(t)
        randoms = _randoms(gm)
        assert len(randoms) == 2  # one per block: the attention probabilities of this rank's heads
        assert len({id(m.tracker) for m in randoms}) == 1  # one stream per rank
        trackers.append(randoms[0].tracker)
        plain = [n for n in gm.graph.nodes if n.op == "call_function" and "dropout" in str(n.target)]
        assert len(plain) == 4 and all(".h." in get_meta(n, MODULE).path for n in plain)
    assert trackers[1].seed == trackers[0].seed + 1


def test_no_stream_without_sharded_random_ops():
    _, _, _, result = planned("plain_tiny", tp=2, options=(("vocab_parallel", True),))
    assert not _randoms(result.graph(0))
