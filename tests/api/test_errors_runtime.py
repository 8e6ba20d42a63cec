"""More bad inputs (docs/errors.md): unsupported ops, BatchNorm over part of the batch, a batch of
the wrong size, a NaN in training. Each is autopar's own error naming what, where and what to do,
and nothing is lost (the model's weights, the program's weights and step counter stay as they were).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.models import build_model, lm_loss


def _mse(out, target):
    return (out - target).pow(2).mean()


def _plan(model, mesh=None, **options):
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    return autopar.plan(model, mesh or {"dp": 1}, example_inputs=(x,), loss_fn=_mse, example_target=y, **options)


class Unique(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)[:, :torch.unique(x).numel() % 4 + 1]


class MaskIndex(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        return y[y > 0].sum() + 0 * y


class NumpyCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(torch.from_numpy(x.detach().numpy()))


@pytest.mark.parametrize("model,op,line", [
    (Unique, "_unique2", "torch.unique(x)"),
    (MaskIndex, "index.Tensor", "y[y > 0]"),
])
def test_op_with_a_data_dependent_shape_is_a_capture_error(model, op, line):
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(autopar.CaptureError) as info:
        _plan(net)
    err = info.value
    assert f"op {op}" in err.what and "depends on the data" in err.what
    assert __file__ in err.where and line in err.where
    assert "fixed-shape" in err.fix
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_op_the_tracer_cannot_follow_is_a_capture_error():
    with pytest.raises(autopar.CaptureError) as info:
        _plan(NumpyCall())
    err = info.value
    assert ".numpy()" in err.what and __file__ in err.where and "x.detach().numpy()" in err.where
    assert "plain torch ops" in err.fix


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("mesh,options,seen", [({"dp": 2}, {"num_microbatches": 1}, "1/2"),
                                               ({"pp": 1}, {"num_microbatches": 4}, "1/4")])
def test_batchnorm_over_part_of_the_batch_is_a_plan_error(mesh, options, seen):
    net = ConvBN()
    x, y = torch.randn(8, 3, 6, 6), torch.randn(8, 4)
    with pytest.raises(autopar.PlanError) as info:
        autopar.plan(net, mesh, example_inputs=(x,), loss_fn=_mse, example_target=y, **options)
    err = info.value
    assert "BatchNorm in training mode" in err.what and f"sees {seen} of the batch" in err.what
    assert "node batch_norm (module norm)" in err.where
    assert "num_microbatches=1" in err.fix and ".eval()" in err.fix and "GroupNorm" in err.fix
    assert torch.equal(net.norm.running_mean, torch.zeros(4))  # the model's statistics untouched


def test_batchnorm_seeing_the_whole_batch_plans():
    x, y = torch.randn(8, 3, 6, 6), torch.randn(8, 4)
    result = autopar.plan(ConvBN(), {"tp": 2}, example_inputs=(x,), loss_fn=_mse, example_target=y,
                          num_microbatches=1)
    assert result.plan.pipeline.num_microbatches == 1




def _gpt_program(mesh, loss_fn=lm_loss):
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    return autopar.compile(build_model("gpt_tiny"), mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=x,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1)), x


def test_batch_of_the_wrong_size_is_a_plan_error(one_rank_mesh):
    """More rows than compiled is refused, with a fix that is not the slicing the user already did; fewer
    rows (an epoch's last batch) train (docs/batches.md)."""
    program, x = _gpt_program(one_rank_mesh)
    with pytest.raises(autopar.PlanError) as info:
        program.train_step(torch.cat([x, x[:1]]), target=torch.cat([x, x[:1]]))
    assert "this rank's batch has 5 rows, more than the 4 the program was compiled for" in info.value.what
    assert "compile on the largest batch" in info.value.fix
    assert program.step_count == 0
    program.train_step(x[:3], target=x[:3])
    assert program.step_count == 1


def test_nan_in_the_loss_is_a_numerics_error_and_the_step_is_not_taken(one_rank_mesh):
    program, x = _gpt_program(one_rank_mesh)
    program.train_step(x, target=x)
    before = program.full_state_dict()
    with torch.no_grad():
        program.named_params[0][1].view(-1)[0] = float("nan")
    poisoned = program.full_state_dict()
    with pytest.raises(autopar.NumericsError) as info:
        program.train_step(x, target=x)
    err = info.value
    assert isinstance(err, autopar.RuntimeCommError)
    assert "non-finite value at training step 2: the loss of microbatch 0 is nan (stage 0)" in err.what
    assert "rank 0, step 2" in err.where and "did not step" in err.fix
    after = program.full_state_dict()
    assert program.step_count == 1
    assert all(torch.allclose(after[k], poisoned[k], rtol=0, atol=0, equal_nan=True)
               for k in before)  # the optimizer did not step


def test_nan_in_a_gradient_alone_is_a_numerics_error(one_rank_mesh):
    def nan_grad(logits, target):
        return lm_loss(logits, target) + 0.0 * torch.sqrt(logits.sum() * 0.0)

    program, x = _gpt_program(one_rank_mesh, loss_fn=nan_grad)
    before = program.full_state_dict()
    with pytest.raises(autopar.NumericsError, match="training step 1: the gradient of .* holds nan"):
        program.train_step(x, target=x)
    after = program.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_init_mesh_timeout_reaches_the_default_and_every_axis_group(monkeypatch):
    """init_mesh(timeout_s=...) bounds every group it makes (NCCL's watchdog, object collectives)."""
    import datetime
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    mesh = autopar.init_mesh(backend="gloo", timeout_s=7)
    try:
        groups = [dist.group.WORLD] + [mesh.get_group(axis) for axis in ("dp", "pp", "tp")]
        for group in groups:
            assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
