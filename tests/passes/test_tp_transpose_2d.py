"""``x.t()`` of a 2-D value sharded over tp: the rule of ``t`` (passes/tp/tp_rules.py) reverses its two dims, as
``.T`` does. It was the rule of ``transpose``, which reads the two dims from the node's arguments: ``t`` has none,
and planning a model with a sharded ``.t()`` stopped with an IndexError. Here a column linear's 2-D output goes
through ``.t().t()`` into a row linear; every tp rank trains like the model (tests/passes/tp_lockstep.py)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from tp_lockstep import run_train, shard_of


class _TwiceTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x):
        return self.down(self.up(x).t().t())


def test_a_sharded_2d_value_transposed_twice_stays_sharded_and_trains_like_the_model():
    torch.manual_seed(0)
    model = _TwiceTransposed()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
    assert {"up.weight", "down.weight"} <= set(result.plan.param_shards), result.plan.param_shards
    mb = result.plan.microbatch_size
    losses, grads = run_train(result, {"x": x[:mb], "target": y[:mb]})
    params = dict(model.named_parameters())
    ref_loss = F.mse_loss(model(x[:mb]), y[:mb])
    ref_grads = dict(zip(params, torch.autograd.grad(ref_loss, list(params.values()))))
    for rank in range(2):
        torch.testing.assert_close(losses[rank], ref_loss.detach(), rtol=1e-5, atol=0)
        for graph_name, grad in grads[rank].items():
            name = graph_name.removeprefix("model.")
            expected = shard_of(ref_grads[name], result.plan.param_shards.get(name), rank=rank, size=2)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
