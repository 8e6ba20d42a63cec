"""Every refusal of the tensor-parallel propagation (passes/tp/tp_rules.py), each on a small model that
trains to a wrong result without it.

Each model reads a column linear's output (sharded on its features over tp) with an op that cannot run on
shards without communication, then a row linear. The rule refuses, the region stays replicated, a
warning names the op and why; and the plan's rank graphs, forward and backward in one process
(tests/passes/tp_lockstep.py), give every rank the unsharded model's loss and its piece of every
gradient. With the refusal taken out of tp_rules.py each case fails (docs/testing.md lists what each
planted removal gave): softmax, log_softmax, slice, cat and split train to a silently wrong loss; select,
index and a reduction of every dim break the plan; amax over the shard and matmul contracting it are then
refused by a second check (the divisibility of the reduced size-1 dim, the other operand's placement), whose
words differ: the test names the refusal it expects.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tp_lockstep import run_train, shard_of

H = 8  # hidden features of the column: 4 per rank at tp=2


class _Region(nn.Module):
    """``down(op(up(x)))``: a column ``up`` (features sharded) and a row ``down`` around ``op``."""

    def __init__(self, op, *, down_in: int = H, d: int = 6):
        super().__init__()
        self.up, self.down, self.op = nn.Linear(d, H), nn.Linear(down_in, d), op

    def forward(self, x):
        return self.down(self.op(self.up(x)))


def _heads(u):
    """(batch, seq, 8) as 2 heads of 4: the heads dim is the sharded one."""
    return u.view(*u.shape[:-1], 2, 4)


# name -> (op between the linears, the row's input width, the refusal's words in the warning)
CASES = {
    "softmax": (lambda u: u.softmax(-1), H, "normalises over the sharded dim"),
    "log_softmax": (lambda u: F.log_softmax(u, dim=-1), H, "normalises over the sharded dim"),
    "amax": (lambda u: u - u.amax(-1, keepdim=True), H, "reduces over the sharded dim"),
    "amax_all": (lambda u: u / u.abs().amax(), H, "reduces every dim"),
    "slice": (lambda u: u[..., 2:6], 4, "slices the sharded dim"),
    "select": (lambda u: _heads(u).select(-2, 0), 4, "selects along the sharded dim"),
    "cat": (lambda u: torch.cat([u, u.relu()], dim=-1), 2 * H, "concatenates along the sharded dim"),
    "split": (lambda u: u.split([2, 6], dim=-1)[1], 6, "splits the sharded dim"),
    "matmul": (lambda u: (u @ u.transpose(-1, -2)) @ u, H, "contracts or keeps a sharded matrix dim"),
    "index": (lambda u: u[..., torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])], H, "indexes the sharded dim"),
}


def _example(d: int = 6):
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 5, d, generator=g), torch.randn(2, 5, d, generator=g)


def _reference(model, x, y):
    params = dict(model.named_parameters())
    loss = F.mse_loss(model(x), y)
    return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("name", list(CASES))
def test_refused_op_keeps_the_model_exact(name, caplog):
    op, down_in, words = CASES[name]
    torch.manual_seed(0)
    model = _Region(op, down_in=down_in)
    x, y = _example()
    with caplog.at_level(logging.WARNING, logger="autopar.passes.tp.tp_regions"):
        result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
    mb = result.plan.microbatch_size
    losses, grads = run_train(result, {"x": x[:mb], "target": y[:mb]})
    ref_loss, ref_grads = _reference(model, x[:mb], y[:mb])
    for rank in range(2):
        torch.testing.assert_close(losses[rank], ref_loss, rtol=1e-5, atol=0, msg=lambda m: f"rank {rank} loss: {m}")
        for graph_name, grad in grads[rank].items():
            user = graph_name.removeprefix("model.")
            expected = shard_of(ref_grads[user], result.plan.param_shards.get(user), rank=rank, size=2)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=user, r=rank: f"rank {r} gradient of {n}: {m}")
    refusals = [r.getMessage() for r in caplog.records if "stays replicated" in r.getMessage()]
    assert any(words in m for m in refusals), f"no refusal saying {words!r}: {refusals}"
