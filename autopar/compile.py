"""``autopar.compile``: inside a torchrun worker, build this rank's parallel program."""
from __future__ import annotations

import logging

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import InputError, PlanError
from autopar.lowering import _is_meta, batch_inputs, lower
from autopar.mesh import mesh_info
from autopar.options import resolve_plan
from autopar.plan_model import Plan
from autopar.runtime.init_replay import init_filler
from autopar.runtime.materialize import materialize_rank
from autopar.runtime.unused_state import keep_unused
from autopar.runtime.program import RankProgram
from autopar.runtime.mixed_precision import masters_for_rank
from autopar.runtime.param_groups import group_template
from autopar.validation import check_arguments, checked_options

__all__ = ["compile", "default_optimizer"]

log = logging.getLogger(__name__)


def default_optimizer(params):
    """AdamW(lr=1e-3): used when compile is given no optimizer factory."""
    return torch.optim.AdamW(params, lr=1e-3)


def _rank_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _shared_seed() -> int:
    """Global rank 0's ``torch.initial_seed()``: every rank replays the same initialisation stream."""
    seed = [torch.initial_seed()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


def _filler(model: nn.Module, weights):
    """How this rank fills a meta-built model's tensors: ``weights`` (a filler) or the model's initialisers;
    None for a model of real tensors."""
    if not _is_meta(model):
        if weights is not None:  # a filler fills meta tensors only: on real weights it would silently do nothing
            raise InputError("compile(weights=...) fills the tensors of a model built on the meta device, but "
                             f"this {type(model).__name__} holds real tensors: the weights would be ignored",
                             where="compile(weights=...)",
                             fix="build the model under torch.device('meta') to load weights this way, or load "
                                 "them into the model before compile (load_state_dict / from_pretrained)")
        return None
    return weights if weights is not None else init_filler(model, seed=_shared_seed())


def _materializer(fill, lowered, *, info, mesh: DeviceMesh, masters):
    """Fills this rank's stage tensors with ``fill`` (None: a model of real tensors, nothing to fill);
    ``masters`` (bf16): receives each parameter's fp32 piece."""
    if fill is None:
        return None
    return partial(materialize_rank, plan=lowered.plan, coords=info.coords, fill=fill, device=_rank_device(mesh),
                   masters=masters)


def _data_parallel(model: nn.Module, opts, plan, info, example_inputs) -> str:
    """The program kind, a Plan decision: a given Plan's, else the options' (resolved in autopar/options.py)."""
    batch = batch_inputs(example_inputs)[1][0].shape[0]
    return resolve_plan(opts, given=plan, mesh=info.shape, batch=batch, model_name=type(model).__name__,
                        num_parameters=0).data_parallel


def compile(model: nn.Module, mesh: DeviceMesh | None, *, example_inputs, loss_fn=None, example_target=None,
            optimizer=None, plan: Plan | str | None = None, cluster=None, weights=None,
            **options) -> RankProgram:
    """Parallelise ``model`` over ``mesh`` and return this rank's :class:`RankProgram`.

    ``example_inputs`` is one global batch (a tensor or a tuple of tensors, batch on dim 0);
    ``loss_fn(output, target)`` turns it into a training program (``program.train_step``),
    without it the program runs inference (``program(*inputs)``). ``optimizer`` is a factory
    ``params -> torch.optim.Optimizer`` (``optimizer_params="named"``: of ``(name, param)`` pairs), called
    once on stand-ins of the whole model to learn its parameter groups (runtime/param_groups.py), then on
    each rank's share. Options: see :class:`autopar.options.CompileOptions`.
    ``plan="auto"``: the planner (autopar/planner) chooses for ``cluster`` (default: this machine);
    with ``mesh=None`` it also chooses dp, pp and tp and builds the mesh (options given pin decisions).
    A model built under ``torch.device("meta")`` is materialised rank by rank: each rank allocates
    only the tensors it holds, filled by ``weights`` (a filler, :mod:`autopar.runtime.materialize`),
    else by the model's own initialisers from global rank 0's ``torch.initial_seed()``
    (:mod:`autopar.runtime.init_replay`: the values a CPU build after ``torch.manual_seed(seed)`` draws).
    """
    check_arguments(model, example_inputs=example_inputs, example_target=example_target, loss_fn=loss_fn, plan=plan,
                    where="compile")  # autopar/validation.py: every argument, before anything runs
    report = None
    if isinstance(plan, str):  # the planner's Plan (and mesh, when none was given)
        from autopar.planner.auto import plan_for_compile
        report, mesh = plan_for_compile(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn,
                                        example_target=example_target, mode=plan, cluster=cluster,
                                        optimizer=optimizer, options=options)
        plan = report.plan
    if not isinstance(mesh, DeviceMesh):
        raise PlanError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}", where="compile(mesh=...)",
                        fix="build one with autopar.init_mesh(dp=..., pp=..., tp=...)")
    info = mesh_info(mesh)
    opts = checked_options(options, mesh=info.shape, plan=plan, where="compile")
    if loss_fn is not None and example_target is None:
        raise PlanError("loss_fn given without example_target", where="compile",
                        fix="pass example_target= (one global batch of targets)")
    factory = optimizer or default_optimizer
    # the factory's parameter groups over the whole model, by name: every rank's shards follow them
    groups = group_template(factory, model.named_parameters(), named=opts.optimizer_params == "named")
    if _data_parallel(model, opts, plan, info, example_inputs) == "dataparallel":  # the rank-0 baseline
        if _is_meta(model):
            raise PlanError("the DataParallel baseline cannot compile a meta-built model",
                            where="compile(data_parallel='dataparallel')",
                            fix="use data_parallel='ddp' (the default), or build the model on a real device")
        from autopar.data_parallel import compile_data_parallel
        return compile_data_parallel(model, info=info, opts=opts, example_inputs=example_inputs,
                                     example_target=example_target, loss_fn=loss_fn,
                                     optimizer_factory=factory, plan=plan, param_groups=groups)
    lowered = lower(model, mesh=info.shape, tp_rank=info.coords["tp"], example_inputs=example_inputs,
                    example_target=example_target, loss_fn=loss_fn, options=opts, plan=plan,
                    dp_rank=info.coords["dp"])
    schedule = lowered.schedule
    state_keys = tuple(model.state_dict().keys())
    masters = None  # fp32 masters of the bf16 graphs: the model's weights, or a meta-built model's pieces
    if lowered.plan.precision == "bf16":
        masters = {} if _is_meta(model) else masters_for_rank(model, lowered, schedule=schedule, info=info)
    fill = _filler(model, weights)
    program_class, extra = RankProgram, {}
    if schedule.staleness is not None:  # asynchronous schedules run one endless stream (runtime/async_pipeline.py)
        from autopar.runtime.async_pipeline import AsyncProgram
        program_class, extra = AsyncProgram, {"options": opts}
    program = program_class(lowered=lowered, info=info, schedule=schedule,
                            optimizer_factory=factory, param_groups=groups, state_keys=state_keys,
                            p2p_timeout_s=opts.p2p_timeout_s, masters=masters, max_grad_norm=opts.max_grad_norm,
                            flight_record=opts.flight_record, run_dir=opts.run_dir,
                            materialize=_materializer(fill, lowered, info=info, mesh=mesh, masters=masters),
                            unused=keep_unused(model, lowered.stages, fill=fill, device=_rank_device(mesh)), **extra)
    log.info("rank %d: %s", info.rank, lowered.plan.summary().splitlines()[0])
    program.planner = report  # the planner's table and reasons when plan="auto"
    program.compile_args = dict(model=model, mesh=mesh, example_inputs=example_inputs, loss_fn=loss_fn,
                                example_target=example_target, optimizer=optimizer, options=options)  # rebalance
    return program
