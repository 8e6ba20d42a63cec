"""On one rank, in this process: lengths that change per step and a partial batch train as one device does,
on graphs that hold the compiled program's own parameters (docs/batches.md). The spawned meshes are in
tests/runtime/test_batches_dist.py."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss

RTOL, ATOL = 1e-5, 1e-6
# (rows, length) of each step: a new length recaptures once (auto), then 9 and 12 reuse it, then 3 rows
STEPS = ((4, 16), (4, 9), (4, 12), (3, 16), (4, 7))


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 128, (rows, seq), generator=g), torch.randint(0, 128, (rows, seq), generator=g))
            for rows, seq in STEPS]


def _model():
    torch.manual_seed(0)
    return build_model("gpt_tiny")


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("mode", ["auto", "seq", "static"])
def test_lengths_and_a_partial_batch_train_equal_to_one_device(one_rank_mesh, mode):
    data = _data()
    model = _model()
    opt = _sgd(list(model.parameters()))
    expected = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    x, y = data[0]
    program = autopar.compile(_model(), one_rank_mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                              optimizer=_sgd, dynamic_shapes=mode, shape_cache_size=2)
    losses = [program.train_step(x, target=y).item() for x, y in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
    state = program.full_state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    cache = program.batching.shapes
    held = {id(p) for _, p in program.named_params}
    for entry in cache.entries():  # every graph trains the compiled program's own parameters
        for stage in entry.stages.values():
            assert {id(p) for p in stage.gm.parameters()} <= held, mode
    # auto: one recapture with the length symbolic (and one more when the rows change); seq: only the rows;
    # static: one graph per new shape, at most 2 kept
    assert cache.num_built == {"auto": 2, "seq": 1, "static": 4}[mode], cache.num_built
    assert len(cache.exact) <= 2
