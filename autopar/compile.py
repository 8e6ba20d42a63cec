"""``autopar.compile``: inside a torchrun worker, build this rank's parallel program."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import PlanError
from autopar.lowering import lower
from autopar.mesh import mesh_info
from autopar.options import CompileOptions
from autopar.plan_model import Plan
from autopar.runtime.program import RankProgram
from autopar.runtime.schedules.registry import build_schedule
from autopar.runtime.schedules.validator import validate

__all__ = ["compile", "default_optimizer"]

log = logging.getLogger(__name__)


def default_optimizer(params):
    """AdamW(lr=1e-3): used when compile is given no optimizer factory."""
    return torch.optim.AdamW(params, lr=1e-3)


def compile(model: nn.Module, mesh: DeviceMesh, *, example_inputs, loss_fn=None, example_target=None,
            optimizer=None, plan: Plan | None = None, **options) -> RankProgram:
    """Parallelise ``model`` over ``mesh`` and return this rank's :class:`RankProgram`.

    ``example_inputs`` is one global batch (a tensor or a tuple of tensors, batch on dim 0);
    ``loss_fn(output, target)`` turns it into a training program (``program.train_step``),
    without it the program runs inference (``program(*inputs)``). ``optimizer`` is a factory
    ``params -> torch.optim.Optimizer``. Options: see :class:`autopar.options.CompileOptions`.
    """
    if not isinstance(mesh, DeviceMesh):
        raise PlanError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}", where="compile(mesh=...)",
                        fix="build one with autopar.init_mesh(dp=..., pp=..., tp=...)")
    info = mesh_info(mesh)
    opts = CompileOptions(**options)
    if loss_fn is not None and example_target is None:
        raise PlanError("loss_fn given without example_target", where="compile",
                        fix="pass example_target= (one global batch of targets)")
    lowered = lower(model, mesh=info.shape, tp_rank=info.coords["tp"], example_inputs=example_inputs,
                    example_target=example_target, loss_fn=loss_fn, options=opts, plan=plan)
    p = lowered.plan.pipeline
    schedule = build_schedule(p.schedule, num_ranks=info.shape.pp, num_microbatches=p.num_microbatches,
                              num_virtual=p.num_virtual)
    validate(schedule)
    state_keys = tuple(model.state_dict().keys())
    program = RankProgram(lowered=lowered, info=info, schedule=schedule,
                          optimizer_factory=optimizer or default_optimizer, state_keys=state_keys,
                          p2p_timeout_s=opts.p2p_timeout_s)
    log.info("rank %d: %s", info.rank, lowered.plan.summary().splitlines()[0])
    return program
