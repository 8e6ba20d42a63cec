"""Everything a user hands to autopar, checked in one place at the API boundary.

``compile``, ``plan``, ``init_mesh`` and checkpoint loading each call one function here before
they do anything else, so a wrong argument gets autopar's own error (what is wrong, where, what
to do) instead of a foreign traceback from deep inside capture, or a silent wrong result:

- :func:`check_arguments`: the model is an ``nn.Module`` with parameters; example inputs are
  tensors (a tensor, a tuple/list, or a dict of str -> tensor; plain Python scalars and None
  may sit among them) sharing one batch size on dim 0; the target is a tensor of that batch; the
  loss is callable; a Plan is a Plan, made for this model and for the mesh asked for;
- :func:`checked_options`: the options, validated, and refused where they would have no effect
  on this mesh (``sequence_parallel=True`` with tp=1);
- :func:`check_captured`: what only the captured graph shows: the loss is a scalar, example
  token ids and positions stay inside the tables they index (:mod:`autopar.passes.frontend.index_bounds`);
- :func:`check_mesh_degrees`, :func:`parse_mesh_shape`, :func:`check_checkpoint_path`, :func:`check_state_dict`.

Example::

    >>> check_arguments(nn.Linear(4, 2), example_inputs=(torch.ones(8, 4),), where="plan")  # fine: no error
    >>> example_tensors({"input_ids": torch.ones(2, 3)}, where="plan")[0][0]
    "example_inputs['input_ids']"
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn as nn

from autopar.errors import InputError, PlanError
from autopar.options import CompileOptions
from autopar.parallel_dims import ParallelDims
from autopar.passes.frontend.index_bounds import annotate_index_bounds, constant_index_problems, index_problem
from autopar.passes.lowering_state import LoweringState
from autopar.passes.pipeline.weight_grad_split import check_split_backward_recompute
from autopar.passes.data_parallel.zero3 import check_zero3
from autopar.plan_model import MESH_AXES, MeshShape, Plan
from autopar.runtime.checkpoints.checkpoint_files import check_checkpoint_path, check_state_dict
from autopar.runtime.schedules.registry import build_schedule, family
from autopar.runtime.schedules.validator import validate

__all__ = ["check_arguments", "checked_options", "check_plan", "check_captured", "check_mesh_degrees",
           "check_checkpoint_path", "check_state_dict", "example_tensors", "parse_mesh_shape"]

_SCALARS = (bool, int, float, str, type(None))  # plain Python values a forward may take beside tensors
_INPUT_KINDS = "a tensor, a tuple/list of tensors, or a dict of str -> tensor"


def _kind(value) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


def check_model(model, *, where: str) -> None:
    """An ``nn.Module`` that holds parameters."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {_kind(model)} {str(model)[:60]!r}",
                         where=f"{where}(model=...)",
                         fix="pass the nn.Module itself; to parallelise a function, call it from the forward "
                             "of an nn.Module that owns its weights as parameters")
    if next(model.parameters(), None) is None:
        raise InputError(f"model {type(model).__name__} has no parameters: there is nothing to shard or train",
                         where=f"{where}(model=...)",
                         fix="pass the module that owns the weights (register them as nn.Parameter or "
                             "submodules, not plain tensor attributes)")


def example_tensors(example_inputs, *, where: str, label: str = "example_inputs") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor among the example inputs (or targets: ``label``); InputError otherwise."""
    at = f"{where}({label}=...)"
    if isinstance(example_inputs, torch.Tensor):
        items = [(label, example_inputs)]
    elif isinstance(example_inputs, (tuple, list)):
        items = [(f"{label}[{i}]", v) for i, v in enumerate(example_inputs)]
    elif isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise InputError(f"{label} has a key {bad[0]!r} that is not a str", where=at,
                             fix="key a dict of example inputs by the forward's argument names")
        items = [(f"{label}[{k!r}]", v) for k, v in example_inputs.items()]
    else:
        raise InputError(f"{label} must be {_INPUT_KINDS}, got {_kind(example_inputs)}", where=at,
                         fix=f"pass one global batch as tensors, e.g. {label}=(tokens,)")
    for name, value in items:
        if not isinstance(value, (torch.Tensor, *_SCALARS)):
            raise InputError(f"{name} is a {_kind(value)}, not a tensor", where=at,
                             fix=f"pass {_INPUT_KINDS} (plain Python numbers and None may sit among them); "
                                 "convert arrays and lists with torch.as_tensor")
    if isinstance(example_inputs, (tuple, list)) and items and not isinstance(items[0][1], torch.Tensor):
        raise InputError(f"{label}[0] is a {_kind(items[0][1])}, not a tensor: the batch is read off the first input",
                         where=at, fix="put a batched tensor first (batch on dim 0), other arguments after it")
    tensors = [(n, v) for n, v in items if isinstance(v, torch.Tensor)]
    if not tensors:
        raise InputError(f"{label} holds no tensor, so the batch size is unknown", where=at,
                         fix="pass at least one tensor, batch on dim 0")
    return tensors


def _batch_of(tensors: list[tuple[str, torch.Tensor]], *, where: str) -> int:
    """The batch size every batched input agrees on (dim 0 of the first tensor)."""
    first, t0 = tensors[0]
    if t0.dim() == 0 or t0.shape[0] == 0:
        raise InputError(f"{first} has shape {tuple(t0.shape)}: no batch on dim 0",
                         where=f"{where}(example_inputs=...)",
                         fix="pass one global batch with at least one sample on dim 0 (a scalar input goes after it)")
    batch = t0.shape[0]
    for name, t in tensors[1:]:
        if t.dim() > 0 and t.shape[0] != batch:
            raise InputError(f"{name} has {t.shape[0]} rows on dim 0 but {first} has {batch}",
                             where=f"{where}(example_inputs=...)",
                             fix="every tensor input with a dim 0 is split on it as the batch: give them all the "
                                 "same batch size (pass a per-model constant as a buffer instead)")
    return batch


def _check_target(example_target, loss_fn, batch: int, *, where: str) -> None:
    if loss_fn is None:
        if example_target is not None:
            raise InputError("example_target given without loss_fn: it would be ignored (an inference program)",
                             where=f"{where}(example_target=...)",
                             fix="pass loss_fn=(output, target) -> scalar to train, or drop example_target")
        return
    if not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (output, target) -> scalar loss, got {_kind(loss_fn)}",
                         where=f"{where}(loss_fn=...)", fix="pass a function such as torch.nn.functional.cross_entropy")
    if example_target is None:
        raise PlanError("loss_fn given without example_target", where=f"{where}(example_target=...)",
                        fix="pass example_target= (one global batch of targets)")
    for name, t in example_tensors(example_target, where=where, label="example_target"):
        if t.dim() == 0 or t.shape[0] != batch:
            rows = "no dim 0" if t.dim() == 0 else f"{t.shape[0]} rows on dim 0"
            raise InputError(f"{name} has {rows} but the example inputs' batch is {batch}",
                             where=f"{where}(example_target=...)",
                             fix=f"pass the targets of the same {batch} samples as the inputs")


def check_plan_matches(plan, *, model: nn.Module, mesh_shape, where: str) -> None:
    """A Plan argument is a Plan, made for this model (name, parameter count) and this mesh."""
    if plan is None or isinstance(plan, str):  # a string is the planner's mode (autopar.planner)
        return
    if not isinstance(plan, Plan):
        raise InputError(f"plan must be an autopar.Plan, 'auto' or None, got {_kind(plan)}", where=f"{where}(plan=...)",
                         fix="pass the Plan a previous autopar.plan(...).plan returned, or "
                             "autopar.Plan.model_validate_json(text) of a saved one")
    name = type(model).__name__
    if plan.model_name not in ("model", name):
        raise PlanError(f"the Plan was made for model {plan.model_name}, not {name}", where=f"{where}(plan=...)",
                        fix="plan this model again (autopar.plan(model, mesh, ...).plan), or pass the model the "
                            "Plan was made for")
    count = sum(p.numel() for p in model.parameters())
    if plan.num_parameters and plan.num_parameters != count:
        raise PlanError(f"the Plan was made for a {name} of {plan.num_parameters:,} parameters; this one has "
                        f"{count:,}", where=f"{where}(plan=...)",
                        fix="plan this model again: its sizes differ from the one the Plan was made for")
    unknown = _unknown_names(plan, model)
    if unknown:
        field, name = unknown[0]
        raise PlanError(f"the Plan's {field} names {name!r}, which {type(model).__name__} does not have"
                        + (f" ({len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                        where=f"{where}(plan=...), Plan.{field}",
                        fix="plan this model again, or edit the Plan to name this model's modules and parameters "
                            "(as model.named_modules() / named_parameters() spell them)")
    if mesh_shape is not None:
        shape = parse_mesh_shape(mesh_shape)
        if shape != plan.mesh:
            raise _mesh_mismatch(plan, shape, where=where)


def _unknown_names(plan: Plan, model: nn.Module) -> list[tuple[str, str]]:
    """(Plan field, name) of every module or parameter the Plan names that ``model`` lacks."""
    modules = {n for n, _ in model.named_modules()}
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    named = [("tp_regions", p) for r in plan.tp_regions for p in r.columns + r.rows]
    named += [("vocab_parallel", p) for p in plan.vocab_parallel]
    bad = [(f, p) for f, p in named if p not in modules]
    return bad + [(f, p) for f in ("param_shards", "shared_params") for p in getattr(plan, f) if p not in params]


def _mesh_mismatch(plan: Plan, shape: MeshShape, *, where: str) -> PlanError:
    return PlanError(f"the Plan was made for mesh {plan.mesh} but the mesh is {shape}", where=f"{where}(plan=...)",
                     fix=f"run on the Plan's mesh ({plan.mesh}), or plan again for {shape} "
                         "(autopar.plan(model, mesh, ...)) and pass that Plan")


def check_arguments(model, *, example_inputs, example_target=None, loss_fn=None, plan=None, mesh_shape=None,
                    where: str) -> None:
    """The arguments of ``compile``/``plan`` (``where`` names the call), before anything is captured."""
    check_model(model, where=where)
    batch = _batch_of(example_tensors(example_inputs, where=where), where=where)
    _check_target(example_target, loss_fn, batch, where=where)
    check_plan_matches(plan, model=model, mesh_shape=mesh_shape, where=where)


def _without_effect(opts: CompileOptions, given: set, mesh: MeshShape) -> tuple[str, str] | None:
    """(the option, why it does nothing) for an option set explicitly that has no effect on ``mesh``."""
    no_tp = "tp=1" if mesh.tp == 1 else "tensor_parallel=False"
    tp_off = mesh.tp == 1 or not opts.tensor_parallel
    if opts.sequence_parallel and tp_off:
        return "sequence_parallel=True", f"it shards activations over tp, and {no_tp}"
    if opts.vocab_parallel and tp_off:
        return "vocab_parallel=True", f"it shards the vocabulary over tp, and {no_tp}"
    pipemare = sorted(k for k in given if k.startswith("pipemare_"))
    if pipemare and opts.schedule != "pipemare":
        return f"{pipemare[0]}={getattr(opts, pipemare[0])}", f"it tunes the 'pipemare' schedule, not {opts.schedule!r}"
    return None


def _expert_parallel_problem(opts: CompileOptions, mesh: MeshShape) -> tuple[str, str] | None:
    """(what is wrong, the fix) for an ``expert_parallel`` this mesh and these options cannot run (docs/moe.md)."""
    ep = opts.expert_parallel
    if ep == 1:
        if opts.moe_capacity_factor is not None:
            return ("moe_capacity_factor has no effect with expert_parallel=1: no tokens are dispatched",
                    "drop moe_capacity_factor, or set expert_parallel")
        return None
    problem = ParallelDims.problem(**mesh.model_dump(), ep=ep)  # ep divides dp (autopar/parallel_dims.py)
    if problem:
        return problem
    if opts.data_parallel != "ddp":
        return f"expert_parallel={ep} needs data_parallel='ddp'", "drop data_parallel='dataparallel'"
    if mesh.tp > 1 and opts.tensor_parallel and opts.sequence_parallel:
        return (f"expert_parallel={ep} with sequence_parallel is not supported yet: the rows an ep rank receives "
                f"vary in number, and the experts' reduce-scatter on them needs a multiple of tp={mesh.tp}",
                "drop sequence_parallel (ep with tp shards the experts without it)")
    return None


def _context_parallel_problem(opts: CompileOptions, mesh: MeshShape) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a cp mesh dim these options cannot run (docs/context_parallel.md)."""
    if mesh.cp == 1:
        return None
    if opts.data_parallel != "ddp":
        return f"cp={mesh.cp} needs data_parallel='ddp'", "drop data_parallel='dataparallel'"
    if family(opts.schedule).asynchronous:
        return (f"cp={mesh.cp} with the asynchronous schedule {opts.schedule!r} is not wired yet: its updates average "
                "over dp alone", "use a synchronous schedule (1f1b, gpipe, zero-bubble, ...) with cp")
    if opts.expert_parallel > 1 and (mesh.tp > 1 or mesh.pp > 1):
        return (f"cp={mesh.cp} with expert_parallel={opts.expert_parallel} and tp={mesh.tp} x pp={mesh.pp} is not "
                "wired yet: cp x ep is judged against one device on dp x cp meshes only",
                "drop tp and pp (cp x ep on dp x cp), or expert_parallel (experts are replicated over cp), or cp")
    if opts.dynamic_shapes == "seq":
        return (f"cp={mesh.cp} cuts a sequence of the compiled length over the cp ranks; dynamic_shapes='seq' keeps "
                "it symbolic", "use dynamic_shapes='auto' or 'static' (pad batches to a multiple of 2 x cp)")
    return None


def checked_options(options: dict, *, mesh: MeshShape, plan=None, where: str) -> CompileOptions:
    """The options as CompileOptions; a Plan made for another mesh, or an option without effect, is refused."""
    opts = CompileOptions(**options)
    if isinstance(plan, Plan) and plan.mesh != mesh:
        raise _mesh_mismatch(plan, mesh, where=where)
    problem = _expert_parallel_problem(opts, mesh)
    if problem:
        raise PlanError(problem[0], where=f"{where}(expert_parallel={opts.expert_parallel}), mesh {mesh}", fix=problem[1])
    problem = _context_parallel_problem(opts, mesh)
    if problem:
        raise PlanError(problem[0], where=f"{where}, mesh {mesh}", fix=problem[1])
    if plan is None:  # with a Plan, the Plan's decisions replace the options
        found = _without_effect(opts, set(options), mesh)
        if found:
            option, why = found
            raise PlanError(f"{option} has no effect on mesh {mesh}: {why}", where=f"{where}({option})",
                            fix=f"drop {option.split('=')[0]}, or use a mesh where it applies")
    return opts


def _first_output(gm) -> object:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out


def _check_scalar_loss(captured) -> None:
    from autopar.ir.meta_keys import TENSOR, get_meta
    out = _first_output(captured.gm)
    info = get_meta(out, TENSOR) if hasattr(out, "meta") else None
    if info is None or info.shape is None:
        raise InputError("loss_fn returned no tensor", where="loss_fn(output, target)",
                         fix="return the loss as a scalar tensor (first, if a tuple is returned)")
    numel = 1
    for d in info.shape:
        numel *= d
    if numel != 1 or info.dtype is None or not info.dtype.is_floating_point:
        raise InputError(f"loss_fn returned a {info.dtype} tensor of shape {tuple(info.shape)}, not a scalar loss",
                         where="loss_fn(output, target)",
                         fix="reduce it to one number, e.g. .mean() (reduction='mean'), before returning it")


def _check_input_values(captured, inputs: tuple) -> None:
    bounds = annotate_index_bounds(captured.gm)  # also marks the inputs the runtime checks every step
    values = dict(zip(captured.input_names, inputs))
    for name, bound in bounds.items():
        value = values.get(name)
        if not isinstance(value, torch.Tensor) or value.is_meta or value.device.type == "meta":
            continue
        problem = index_problem(value, bound.rows, bound.low)
        if problem:
            raise InputError(f"example input {name!r} {problem}", where=f"input {name!r} indexing {bound.lookups[0]}",
                             fix=f"keep {name} in {bound.low}..{bound.rows - 1} (e.g. token ids below the vocabulary "
                                 "size), "
                                 "or grow the table")


def check_plan(st: LoweringState) -> LoweringState:
    """A check pass, before the (slow) capture: what the Plan alone decides. ``schedule``: its schedule, built
    and validated once for every rank; a schedule that cannot run these sizes, recompute modes a split backward
    cannot run and a ZeRO-3 the pipeline cannot are refused."""
    plan, p = st.plan, st.plan.pipeline
    schedule = build_schedule(p.schedule, num_ranks=plan.mesh.pp, num_microbatches=p.num_microbatches,
                              num_virtual=p.num_virtual)
    validate(schedule)
    if (st.source.loss_fn is not None or st.source.own_loss) and schedule.split_backward:
        check_split_backward_recompute(plan.recompute or ("none",), schedule=p.schedule)
    if plan.zero_stage == 3 and plan.data_parallel == "ddp":
        check_zero3(p)
    return dataclasses.replace(st, schedule=schedule)


def check_captured(st: LoweringState) -> LoweringState:
    """A check pass: what the captured graph shows: a scalar loss, example indices inside their tables, a long
    enough position table (the full example inputs and target, in the graph's input order)."""
    captured, src = st.captured, st.source
    _check_captured(captured, inputs=src.inputs + captured.extra_args + ((src.target,) if src.loss_fn is not None
                                                                          else ()))
    return st


def _check_captured(captured, *, inputs: tuple) -> None:
    if captured.has_loss:
        _check_scalar_loss(captured)
    _check_input_values(captured, inputs)
    problems = constant_index_problems(captured.gm)
    if problems:
        lookup, problem = problems[0]
        raise InputError(f"the index of {lookup.name}, computed from the example's shapes, {problem}",
                         where=f"lookup {lookup.node.name} ({lookup.name.split(' ')[0]})",
                         fix=f"shorten the sequence (or the dim that sizes it) to at most {lookup.rows}, or grow "
                             "the table (e.g. the model's seq_len / max_position_embeddings)")


def check_mesh_degrees(*, dp, pp, tp, backend, timeout_s, cp=1) -> None:
    """init_mesh's arguments: int degrees, a backend name, a positive timeout."""
    for axis, value in (("dp", dp), ("cp", cp), ("pp", pp), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InputError(f"mesh degree {axis}={value!r} is a {_kind(value)}, not an int",
                             where=f"init_mesh({axis}=...)",
                             fix=f"pass {axis} as a positive int, e.g. init_mesh({axis}=2)")
    if backend is not None and not isinstance(backend, str):
        raise InputError(f"backend={backend!r} is not a name", where="init_mesh(backend=...)",
                         fix="pass 'gloo', 'nccl' or None (NCCL on CUDA, else gloo)")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise InputError(f"timeout_s={timeout_s!r} is not a positive number of seconds",
                         where="init_mesh(timeout_s=...)",
                         fix="pass seconds as a positive number, or None for torch's default")


def parse_mesh_shape(shape) -> MeshShape:
    """A MeshShape from a MeshShape, a dict {'dp': 2, 'cp': 2, ...} or a (dp, pp, tp) tuple."""
    if isinstance(shape, MeshShape):
        return shape
    if isinstance(shape, dict):
        unknown = sorted(set(shape) - set(MESH_AXES))
        if unknown:
            raise PlanError(f"unknown mesh dim names {unknown}", where="mesh_shape",
                            fix=f"name mesh dims from {MESH_AXES}")
        return MeshShape(**shape)
    if isinstance(shape, (tuple, list)) and len(shape) == 3:
        return MeshShape(dp=shape[0], pp=shape[1], tp=shape[2])
    raise PlanError(f"cannot read mesh shape {shape!r}", where="mesh_shape",
                    fix="pass {'dp': 2, 'pp': 2, 'tp': 1} or a (dp, pp, tp) tuple")
