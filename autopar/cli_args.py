"""What the ``autopar`` subcommands share: argument types, the mesh flag, loading a ``MODULE:CALLABLE`` target.

``autopar inspect`` (:mod:`autopar.cli`), ``autopar plan`` (:mod:`autopar.planner.cli`) and
``autopar train`` (:mod:`autopar.demo`) read their flags with these, so the subcommands import
this module and never each other.

Example::

    >>> parse_mesh("dp=2,tp=2")
    MeshShape(dp=2, pp=1, tp=2, cp=1)
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
import torch.nn as nn

from autopar.errors import PlanError
from autopar.plan_model import MESH_AXES, MeshShape
from autopar.runtime.schedules.registry import schedule_names

__all__ = ["DTYPES", "positive_int", "add_schedule_arguments", "add_example_input_arguments", "parse_mesh", "load_target", "random_inputs",
           "unpack_target"]

DTYPES = {"long": torch.long, "int": torch.int32, "float": torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """--schedule, --microbatches and --virtual, shared by inspect and train."""
    parser.add_argument("--schedule", default="1f1b", choices=schedule_names(), metavar="NAME",
                        help=f"pipeline schedule, one of {', '.join(schedule_names())} (default 1f1b)")
    parser.add_argument("--microbatches", type=positive_int, default=None, metavar="N",
                        help="microbatches per step (default: chosen by autopar)")
    parser.add_argument("--virtual", type=positive_int, default=1, metavar="V",
                        help="pipeline stages per pp rank (default 1; interleaved_1f1b needs 2 or more)")


def add_example_input_arguments(parser: argparse.ArgumentParser) -> None:
    """--input-shape, --input-dtype, --vocab and --seed: random example inputs for a target that returns a bare model."""
    bare = parser.add_argument_group("example inputs for a target that returns a bare model")
    bare.add_argument("--input-shape", metavar="DxD..", help="shape of the one input, batch first, e.g. 8x32")
    bare.add_argument("--input-dtype", default="long", choices=sorted(DTYPES), help="its dtype (default long)")
    bare.add_argument("--vocab", type=int, default=None, metavar="N",
                      help="integer inputs are drawn from [0, N) (default: model.cfg.vocab_size)")
    bare.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")


def parse_mesh(text: str) -> MeshShape:
    """``"dp=2,pp=2,tp=1"`` -> MeshShape; axes left out are 1; raises PlanError on anything else."""
    fix = "write the mesh as comma-separated AXIS=DEGREE pairs, e.g. --mesh dp=2,pp=2,tp=1 or dp=2,cp=2"
    degrees: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        axis, sep, value = part.partition("=")
        axis = axis.strip()
        if not sep or axis not in MESH_AXES:
            raise PlanError(f"cannot read mesh entry {part!r} of {text!r}: expected AXIS=DEGREE with AXIS "
                            f"one of {', '.join(MESH_AXES)}", where="--mesh", fix=fix)
        if axis in degrees:
            raise PlanError(f"mesh axis {axis!r} is given twice in {text!r}", where="--mesh", fix=fix)
        try:
            degree = int(value)
        except ValueError:
            degree = 0
        if degree < 1:
            raise PlanError(f"mesh degree {axis}={value.strip()!r} is not a positive integer", where="--mesh",
                            fix=fix)
        degrees[axis] = degree
    return MeshShape(**degrees)


def load_target(target: str):
    """Import ``MODULE:CALLABLE`` and call it; PlanError when either cannot be found."""
    module_name, sep, attr = target.partition(":")
    fix = "give TARGET as MODULE:CALLABLE, e.g. autopar.models.examples:gpt_tiny"
    if not sep or not module_name or not attr:
        raise PlanError(f"target {target!r} is not of the form MODULE:CALLABLE", where="TARGET", fix=fix)
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: modules of this directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(f"cannot import module {module_name!r}: {exc}", where="TARGET",
                        fix="check the module name and that it is on PYTHONPATH") from exc
    fn = module
    for name in attr.split("."):
        if not hasattr(fn, name):
            raise PlanError(f"module {module_name!r} has no attribute {attr!r}", where="TARGET",
                            fix=f"name a callable defined in {module_name}")
        fn = getattr(fn, name)
    if not callable(fn):
        raise PlanError(f"{target} is a {type(fn).__name__}, not a callable", where="TARGET", fix=fix)
    return fn()


def random_inputs(model: nn.Module, args: argparse.Namespace) -> tuple[torch.Tensor]:
    """Example inputs for a bare model from --input-shape / --input-dtype / --vocab."""
    if not args.input_shape:
        raise PlanError("the target returned a bare model, so its example inputs are unknown", where="TARGET",
                        fix="pass --input-shape (e.g. 8x32) and --input-dtype, or return (model, inputs)")
    try:
        shape = tuple(int(d) for d in args.input_shape.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise PlanError(f"cannot read --input-shape {args.input_shape!r}", where="--input-shape",
                        fix="write the dims joined by x, batch first, e.g. 8x32")
    dtype = DTYPES[args.input_dtype]
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(args.seed)
    if dtype.is_floating_point:
        data = torch.randn(shape, generator=gen, dtype=dtype)
    else:
        vocab = args.vocab or getattr(getattr(model, "cfg", None), "vocab_size", None)
        if not vocab:
            raise PlanError("integer inputs need a range", where="--input-dtype", fix="pass --vocab N")
        data = torch.randint(0, vocab, shape, generator=gen, dtype=dtype)
    return (data.to(device),)


def unpack_target(obj, args: argparse.Namespace) -> dict:
    """The target's return value as keyword arguments of autopar.plan."""
    if isinstance(obj, nn.Module):
        return {"model": obj, "example_inputs": random_inputs(obj, args)}
    if isinstance(obj, tuple) and len(obj) in (2, 4) and isinstance(obj[0], nn.Module):
        inputs = obj[1] if isinstance(obj[1], (tuple, list)) else (obj[1],)
        out = {"model": obj[0], "example_inputs": tuple(inputs)}
        if len(obj) == 4:
            out.update(loss_fn=obj[2], example_target=obj[3])
        return out
    raise PlanError(f"the target returned {type(obj).__name__}, not a model or a (model, inputs[, loss_fn, "
                    f"target]) tuple", where="TARGET", fix="return model, (model, example_inputs) or "
                                                           "(model, example_inputs, loss_fn, example_target)")
