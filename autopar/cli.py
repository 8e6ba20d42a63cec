"""The ``autopar`` command: ``inspect`` a model's plan and graphs, ``train`` the demo GPT.

    autopar inspect autopar.models.examples:gpt_tiny --mesh dp=1,pp=2,tp=2 --rank 0
    autopar train --mesh dp=1,pp=2,tp=2 --steps 100

``python -m autopar`` is the same command. Errors in what was asked (a bad ``--mesh``, a module
that does not import, a model that does not fit the mesh) print autopar's message and exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import torch
import torch.nn as nn

from autopar.errors import AutoparError, PlanError
from autopar.plan_model import MESH_AXES, MeshShape
from autopar.runtime.schedules.registry import schedule_names

__all__ = ["main", "build_parser", "parse_mesh", "positive_int", "add_schedule_arguments", "load_target"]

_DTYPES = {"long": torch.long, "int": torch.int32, "float": torch.float32, "float32": torch.float32,
           "bfloat16": torch.bfloat16, "float16": torch.float16}

_MAIN_EPILOG = """\
examples:
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=1,pp=2,tp=2 --rank 0
  autopar inspect autopar.models.examples:llama2_70b_meta --mesh dp=1,pp=4,tp=1 --json
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=2,pp=2,tp=2 --html report.html
  autopar plan autopar.models.examples:gpt_tiny --world 8 --cluster cpu-2core
  autopar train --mesh dp=1,pp=2,tp=2 --steps 100

run 'autopar COMMAND --help' for the options of one command."""

_INSPECT_DESCRIPTION = """\
Plan a model for a dp x pp x tp mesh in this one process (no process group, no GPUs) and
print the Plan's summary and the rewritten graph of the chosen rank(s): the tensor-parallel
collectives (tp_copy_*, tp_reduce_*) and pipeline send_*/recv_* nodes appear in the code.

TARGET is MODULE:CALLABLE. The callable takes no arguments and returns one of
  model                                        (then give --input-shape, see below)
  (model, example_inputs)
  (model, example_inputs, loss_fn, example_target)
where example_inputs is one global batch (a tensor or a tuple of tensors, batch on dim 0).
Models built under torch.device("meta") plan without allocating their weights.
--html PATH also writes all of it as one self-contained web page (with the schedule's
timeline and memory per rank); --diff prints what the compiler changed in rank R's graph.

A callable that returns a bare model gets random example inputs of --input-shape
(e.g. 8x32) and --input-dtype; integer inputs are drawn from [0, --vocab), which defaults
to model.cfg.vocab_size when the model has one."""

_INSPECT_EPILOG = """\
examples:
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=1,pp=2,tp=2 --rank 0
  autopar inspect autopar.models.examples:llama_tiny --mesh dp=2,pp=2,tp=1 --schedule gpipe --all-ranks
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=2,pp=2,tp=1 --json > plan.json
  autopar inspect autopar.models.examples:gpt_tiny_model --mesh pp=2 --input-shape 8x32 --input-dtype long
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=2,pp=2,tp=2 --html report.html
  autopar inspect autopar.models.examples:gpt_tiny --mesh pp=2,tp=2 --diff --rank 3"""


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


def parse_mesh(text: str) -> MeshShape:
    """``"dp=2,pp=2,tp=1"`` -> MeshShape; axes left out are 1; raises PlanError on anything else."""
    fix = "write the mesh as comma-separated AXIS=DEGREE pairs, e.g. --mesh dp=2,pp=2,tp=1"
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


def _random_inputs(model: nn.Module, args: argparse.Namespace) -> tuple[torch.Tensor]:
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
    dtype = _DTYPES[args.input_dtype]
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


def _unpack(obj, args: argparse.Namespace) -> dict:
    """The target's return value as keyword arguments of autopar.plan."""
    if isinstance(obj, nn.Module):
        return {"model": obj, "example_inputs": _random_inputs(obj, args)}
    if isinstance(obj, tuple) and len(obj) in (2, 4) and isinstance(obj[0], nn.Module):
        inputs = obj[1] if isinstance(obj[1], (tuple, list)) else (obj[1],)
        out = {"model": obj[0], "example_inputs": tuple(inputs)}
        if len(obj) == 4:
            out.update(loss_fn=obj[2], example_target=obj[3])
        return out
    raise PlanError(f"the target returned {type(obj).__name__}, not a model or a (model, inputs[, loss_fn, "
                    f"target]) tuple", where="TARGET", fix="return model, (model, example_inputs) or "
                                                           "(model, example_inputs, loss_fn, example_target)")


def _run_inspect(args: argparse.Namespace) -> int:
    """`autopar inspect`: plan in this process and print the summary and graphs (or the Plan JSON)."""
    import autopar

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    shape = parse_mesh(args.mesh)
    if args.rank is not None and not 0 <= args.rank < shape.world_size:
        raise PlanError(f"rank {args.rank} is outside the mesh {shape} (ranks 0..{shape.world_size - 1})",
                        where="--rank", fix=f"pick a rank below {shape.world_size}")
    kwargs = _unpack(load_target(args.target), args)
    options = {"schedule": args.schedule, "num_microbatches": args.microbatches, "num_virtual": args.virtual,
               "capture": args.capture, "tensor_parallel": not args.no_tensor_parallel}
    result = autopar.plan(kwargs.pop("model"), shape, **kwargs, **options)
    if args.html:
        from autopar.report import write_report
        print(f"wrote the report to {write_report(result, args.html)}", file=sys.stderr)
    if args.json:
        print(result.plan.model_dump_json(indent=2))
        return 0
    ranks = sorted(result.ranks) if args.all_ranks else [args.rank or 0]
    if args.diff:
        from autopar.report import graph_diff
        print("\n\n".join(graph_diff(result, rank) for rank in ranks))
        return 0
    print(result.summary())
    if args.html and args.rank is None and not args.all_ranks:  # the graphs are in the report
        return 0
    for rank in ranks:
        print()
        print(result.describe_rank(rank))
    return 0


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="plan a model for a mesh and print the plan and a rank's graphs",
                       description=_INSPECT_DESCRIPTION, epilog=_INSPECT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="MODULE:CALLABLE returning a model or (model, inputs, ...)")
    p.add_argument("--mesh", required=True, help="mesh degrees, e.g. dp=2,pp=2,tp=1 (axes left out are 1)")
    add_schedule_arguments(p)
    p.add_argument("--capture", default="export", choices=("export", "symbolic_trace"),
                   help="how the model is captured as a graph (default export)")
    p.add_argument("--no-tensor-parallel", action="store_true", help="keep every weight whole along tp")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=None, metavar="R", help="print rank R's graphs (default 0)")
    which.add_argument("--all-ranks", action="store_true", help="print every rank's graphs")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON instead (autopar.Plan)")
    p.add_argument("--diff", action="store_true",
                   help="print the captured graph against rank R's (or every rank's) rewritten graphs instead "
                        "(+ inserted, - removed, ~ changed)")
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report: the Plan, the "
                   "schedule's timeline, memory per rank and every rewritten graph (autopar.report)")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level of autopar's messages on stderr (default WARNING)")
    bare = p.add_argument_group("example inputs for a target that returns a bare model")
    bare.add_argument("--input-shape", metavar="DxD..", help="shape of the one input, batch first, e.g. 8x32")
    bare.add_argument("--input-dtype", default="long", choices=sorted(_DTYPES), help="its dtype (default long)")
    bare.add_argument("--vocab", type=int, default=None, metavar="N",
                      help="integer inputs are drawn from [0, N) (default: model.cfg.vocab_size)")
    bare.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=_run_inspect)


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` argument parser with its subcommands."""
    from autopar import demo

    parser = argparse.ArgumentParser(
        prog="autopar", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_MAIN_EPILOG,
        description="autopar parallelises PyTorch models over dp x pp x tp meshes by rewriting their graphs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_inspect(sub)
    from autopar.planner.cli import add_plan_command
    add_plan_command(sub)  # autopar plan: the planner's ranked table and reasons (autopar/planner/cli.py)
    train = sub.add_parser("train", help="train a small GPT on a dp x pp x tp mesh of CPU processes (demo)",
                           description=demo.DESCRIPTION, epilog=demo.EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(train)
    train.set_defaults(func=demo.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autopar`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AutoparError as exc:
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `autopar inspect ... | head`: stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
