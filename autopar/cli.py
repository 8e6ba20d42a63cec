"""The ``autopar`` command: ``inspect`` a model's plan and graphs, ``train`` the demo GPT, ``diagnose`` a run.

    autopar inspect autopar.models.examples:gpt_tiny --mesh dp=1,pp=2,tp=2 --rank 0
    autopar train --mesh dp=1,pp=2,tp=2 --steps 100
    autopar diagnose RUN_DIR

``python -m autopar`` is the same command. Errors in what was asked (a bad ``--mesh``, a module
that does not import, a model that does not fit the mesh) print autopar's message and exit 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from autopar.cli_args import add_example_input_arguments, add_schedule_arguments, load_target, parse_mesh, positive_int, unpack_target
from autopar.errors import AutoparError, PlanError

__all__ = ["main", "build_parser", "parse_mesh", "positive_int", "add_schedule_arguments", "load_target"]

_MAIN_EPILOG = """\
examples:
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=1,pp=2,tp=2 --rank 0
  autopar inspect autopar.models.examples:llama2_70b_meta --mesh dp=1,pp=4,tp=1 --json
  autopar inspect autopar.models.examples:gpt_tiny --mesh dp=2,pp=2,tp=2 --html report.html
  autopar plan autopar.models.examples:gpt_tiny --world 8 --cluster cpu-2core
  autopar coverage autopar.models.examples:gpt_tiny --tp 2
  autopar train --mesh dp=1,pp=2,tp=2 --steps 100
  autopar diagnose RUN_DIR

run 'autopar COMMAND --help' for the options of one command."""

_INSPECT_DESCRIPTION = """\
Plan a model for a dp x pp x tp mesh (a cp axis too: context parallelism) in this one process
(no process group, no GPUs) and print the Plan's summary, the schedule's critical path (simulated
with each stage's FLOPs) and the rewritten graph of the chosen rank(s): the tensor-parallel
collectives (tp_copy_*, tp_reduce_*), pipeline send_*/recv_* nodes and context parallelism's
attention nodes (cp_attention_*, each listed after the code as RingAttention or UlyssesAttention)
appear in the code.

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
  autopar inspect autopar.models.examples:gpt_tiny --mesh pp=2,tp=2 --diff --rank 3
  autopar inspect autopar.models.examples:llama_tiny --mesh dp=1,cp=2 --cp-strategy ring --rank 1"""


def _run_inspect(args: argparse.Namespace) -> int:
    """`autopar inspect`: plan in this process and print the summary and graphs (or the Plan JSON)."""
    import autopar

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    shape = parse_mesh(args.mesh)
    if args.rank is not None and not 0 <= args.rank < shape.world_size:
        raise PlanError(f"rank {args.rank} is outside the mesh {shape} (ranks 0..{shape.world_size - 1})",
                        where="--rank", fix=f"pick a rank below {shape.world_size}")
    kwargs = unpack_target(load_target(args.target), args)
    options = {"schedule": args.schedule, "num_microbatches": args.microbatches, "num_virtual": args.virtual,
               "capture": args.capture, "tensor_parallel": not args.no_tensor_parallel}
    if shape.cp == 1 and (args.cp_strategy != "auto" or args.cp_contiguous):
        raise PlanError(f"--cp-strategy/--cp-contiguous given for the mesh {shape}, which has no cp axis",
                        where="--mesh", fix="add cp=N (N > 1) to --mesh, e.g. --mesh dp=1,cp=2, or drop those flags")
    options.update(cp_strategy=args.cp_strategy, cp_load_balanced=not args.cp_contiguous)
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
    from autopar.report.timeline import simulate_plan
    timing = simulate_plan(result)  # stage costs from FLOPs, as the report's timeline
    print(timing.sim.critical_path.summary(unit=f"units ({timing.unit})"))
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
    p.add_argument("--cp-strategy", default="auto", choices=("auto", "ring", "all_to_all"),
                   help="with cp in --mesh: attention by the K/V ring, by all-to-all, or auto (default)")
    p.add_argument("--cp-contiguous", action="store_true",
                   help="with cp in --mesh: each rank one contiguous chunk (default: load-balanced chunk pairs)")
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
    add_example_input_arguments(p)
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
    from autopar.coverage_cli import add_coverage_command
    add_coverage_command(sub)  # autopar coverage: how each weight is sharded over tp (autopar/coverage_cli.py)
    from autopar.diagnose_cli import add_diagnose_command
    add_diagnose_command(sub)  # autopar diagnose: the job-wide diagnosis of a run (autopar/diagnose_cli.py)
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
