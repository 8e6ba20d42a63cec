"""The sharded graphs train like the model: forward AND backward of every tp rank, vocabulary sharded,
run in one process (tests/passes/tp_lockstep.py emulates the collectives from their definitions).

Every rank's loss equals the unsharded model's, and every rank's gradient of every parameter it holds
equals its piece of the unsharded model's gradient (the piece cut as ``ParamShard`` defines it, by
tp_lockstep.shard_of, not by the pass). tests/passes/test_tensor_parallel.py runs the forward only,
with the vocabulary left whole.
"""
from __future__ import annotations

import pytest
import torch

from autopar.models import lm_loss
from graph_runner import planned
from tp_lockstep import run_train, shard_of

CASES = [("gpt_tiny", 2, ()), ("llama_tiny", 2, ()), ("gpt_tiny", 4, ()), ("llama_tiny", 4, (("num_kv_heads", 2),))]


def _reference(model, x, y):
    """The unsharded model's loss and gradients."""
    params = dict(model.named_parameters())
    loss = lm_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads))


def assert_trains_like(result, model, inputs: dict, reference) -> None:
    """Every tp rank's loss and gradients against ``reference`` (loss, {name: grad}) of ``model``."""
    tp = result.plan.mesh.tp
    losses, grads = run_train(result, inputs)
    ref_loss, ref_grads = reference
    full = dict(model.named_parameters(remove_duplicate=False))
    specs = result.plan.param_shards
    seen = set()
    for rank in range(tp):
        torch.testing.assert_close(losses[rank], ref_loss, rtol=1e-5, atol=0, msg=lambda m: f"rank {rank} loss: {m}")
        for graph_name, grad in grads[rank].items():
            name = graph_name.removeprefix("model.")
            owner = next(n for n, p in model.named_parameters() if p is full[name])
            spec = specs.get(name)
            expected = shard_of(ref_grads[owner], spec, rank=rank, size=tp)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"rank {r} gradient of {n}: {m}")
            seen.add(owner)
    assert seen == set(ref_grads), f"parameters no rank holds: {set(ref_grads) - seen}"


@pytest.mark.parametrize("name,tp,overrides", CASES, ids=[f"{n}-tp{t}" for n, t, _ in CASES])
def test_vocab_sharded_ranks_train_like_the_model(name, tp, overrides):
    model, x, y, result = planned(name, tp=tp, overrides=overrides, options=(("vocab_parallel", True),))
    assert result.plan.vocab_parallel, "the vocabulary is not sharded: the test would not test it"
    mb = result.plan.microbatch_size
    assert_trains_like(result, model, {"idx": x[:mb], "target": y[:mb]}, _reference(model, x[:mb], y[:mb]))
