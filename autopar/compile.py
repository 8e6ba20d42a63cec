"""``autopar.compile``: inside a torchrun worker, build this rank's parallel program."""
from __future__ import annotations

import logging

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import InputError, PlanError
from autopar.lowering import _is_meta, resolve
from autopar.mesh import mesh_info, mesh_shape_of
from autopar.plan_model import Plan
from autopar.shape_builder import lower_program, make_builder
from autopar.runtime.execution.init_replay import init_filler
from autopar.runtime.state.materialize import materialize_rank
from autopar.runtime.state.unused_state import keep_unused
from autopar.runtime.execution.program import RankProgram
from autopar.runtime.state.mixed_precision import masters_for_rank
from autopar.runtime.state.param_groups import group_template
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


def compile(model: nn.Module, mesh: DeviceMesh | None, *, example_inputs, loss_fn=None, example_target=None,
            optimizer=None, plan: Plan | str | None = None, cluster=None, weights=None,
            **options) -> RankProgram:
    """Parallelise ``model`` over ``mesh`` and return this rank's :class:`RankProgram`.

    ``example_inputs`` is one global batch (a tensor or a tuple of tensors, batch on dim 0);
    ``loss_fn(output, target)`` turns it into a training program (``program.train_step``),
    without it the program runs inference (``program(*inputs)``). ``optimizer`` is a factory
    ``params -> torch.optim.Optimizer`` (``optimizer_params="named"``: of ``(name, param)`` pairs), called
    once on stand-ins of the whole model to learn its parameter groups (runtime/state/param_groups.py), then on
    each rank's share. Options: see :class:`autopar.options.CompileOptions`.
    ``plan="auto"``: the planner (autopar/planner) chooses for ``cluster`` (default: this machine);
    with ``mesh=None`` it also chooses dp, pp and tp and builds the mesh (options given pin decisions).
    A model built under ``torch.device("meta")`` is materialised rank by rank: each rank allocates
    only the tensors it holds, filled by ``weights`` (a filler, :mod:`autopar.runtime.state.materialize`),
    else by the model's own initialisers from global rank 0's ``torch.initial_seed()``
    (:mod:`autopar.runtime.execution.init_replay`: the values a CPU build after ``torch.manual_seed(seed)`` draws).
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
    shape = mesh_shape_of(mesh)
    opts = checked_options(options, mesh=shape, plan=plan, where="compile")
    if loss_fn is not None and example_target is None:
        raise PlanError("loss_fn given without example_target", where="compile",
                        fix="pass example_target= (one global batch of targets)")
    # the Plan, resolved once (the planner's comes resolved): everything below reads it, not the options
    resolved = report.plan if report is not None else resolve(model, mesh=shape, example_inputs=example_inputs,
                                                               options=opts, plan=plan)
    info = mesh_info(mesh, dims=resolved.dims)  # every group, ep and edp too, from the one DeviceMesh
    factory = optimizer or default_optimizer
    # the factory's parameter groups over the whole model, by name: every rank's shards follow them
    groups = group_template(factory, model.named_parameters(), named=resolved.run.optimizer_params == "named")
    if resolved.data_parallel == "dataparallel":  # the rank-0 baseline
        if _is_meta(model):
            raise PlanError("the DataParallel baseline cannot compile a meta-built model",
                            where="compile(data_parallel='dataparallel')",
                            fix="use data_parallel='ddp' (the default), or build the model on a real device")
        from autopar.data_parallel import compile_data_parallel
        return compile_data_parallel(model, info=info, opts=opts, example_inputs=example_inputs,
                                     example_target=example_target, loss_fn=loss_fn,
                                     optimizer_factory=factory, plan=resolved, pinned=plan is not None,
                                     param_groups=groups)
    cap, lowered = lower_program(model, plan=resolved, pinned=plan is not None, tp_rank=info.coords["tp"],
                                 example_inputs=example_inputs, example_target=example_target, loss_fn=loss_fn,
                                 options=opts, dp_rank=info.coords["dp"], cp_rank=info.coords.get("cp", 0))
    schedule = lowered.schedule
    mine = [s for s, r in enumerate(schedule.stage_to_rank) if r == info.coords["pp"]]
    builder = make_builder(cap, lowered, model=model, tp_rank=info.coords["tp"], dp_rank=info.coords["dp"],
                           stages=mine, cp_rank=info.coords.get("cp", 0))
    state_keys = tuple(model.state_dict().keys())
    masters = None  # fp32 masters of the bf16 graphs: the model's weights, or a meta-built model's pieces
    if lowered.plan.precision == "bf16":
        masters = {} if _is_meta(model) else masters_for_rank(model, lowered, schedule=schedule, info=info)
    fill = _filler(model, weights)
    program_class = RankProgram
    if schedule.staleness is not None:  # asynchronous: one endless stream (runtime/execution/async_pipeline.py)
        from autopar.runtime.execution.async_pipeline import AsyncProgram
        program_class = AsyncProgram
    program = program_class(lowered=lowered, info=info, schedule=schedule,  # (how it runs: lowered.plan.run)
                            optimizer_factory=factory, param_groups=groups, state_keys=state_keys, masters=masters,
                            materialize=_materializer(fill, lowered, info=info, mesh=mesh, masters=masters),
                            unused=keep_unused(model, lowered.stages, fill=fill, device=_rank_device(mesh)),
                            builder=builder if schedule.staleness is None else None)  # (async: compiled shapes)
    log.info("rank %d: %s", info.rank, lowered.plan.summary().splitlines()[0])
    program.planner = report  # the planner's table and reasons when plan="auto"
    program.compile_args = dict(model=model, mesh=mesh, example_inputs=example_inputs, loss_fn=loss_fn,
                                example_target=example_target, optimizer=optimizer, options=options)  # rebalance
    return program
