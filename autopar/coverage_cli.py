"""``autopar coverage MODULE:CALLABLE --tp N``: how much of a model tensor parallelism shards.

Prints :func:`autopar.coverage`'s report: each weight with 2 or more dims, how it is sharded
(column, row, vocab, expert column, expert row) or the op and the reason it stays replicated,
and the share of those weights' elements that are sharded. TARGET is as ``autopar inspect``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

__all__ = ["add_coverage_command"]

_DESCRIPTION = """\
Plan a model at tensor-parallel degree N in this one process (no process group) and list, for
each weight with 2 or more dims (every weight with --all), how it is sharded -- column, row,
vocab, expert column, expert row, with its dim and blocks -- or the op that reads it and the
reason it stays replicated; then the share of the elements of those weights that is sharded.

TARGET is MODULE:CALLABLE, as for `autopar inspect`: the callable returns a model (then give
--input-shape), (model, example_inputs) or (model, example_inputs, loss_fn, example_target)."""

_EPILOG = """\
examples:
  autopar coverage autopar.models.examples:gpt_tiny --tp 2
  autopar coverage autopar.models.examples:llama_tiny --tp 4 --json
  autopar coverage autopar.models.examples:gpt_tiny_model --tp 2 --input-shape 8x32"""


def _run_coverage(args: argparse.Namespace) -> int:
    import autopar
    from autopar.cli_args import load_target, unpack_target

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    kwargs = unpack_target(load_target(args.target), args)
    report = autopar.coverage(kwargs.pop("model"), kwargs.pop("example_inputs"), tp=args.tp, **kwargs)
    if args.json:
        out = dataclasses.asdict(report)
        out["share"] = report.share
        print(json.dumps(out, indent=2))
        return 0
    print(report.table(min_dims=1 if args.all else 2))
    return 0


def add_coverage_command(sub) -> None:
    """The ``coverage`` subcommand of the ``autopar`` parser."""
    from autopar.cli_args import add_example_input_arguments, positive_int

    p = sub.add_parser("coverage", help="how each weight is sharded at tp=N, or why it stays replicated",
                       description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="MODULE:CALLABLE returning a model or (model, inputs, ...)")
    p.add_argument("--tp", type=positive_int, required=True, metavar="N", help="tensor-parallel degree")
    p.add_argument("--all", action="store_true", help="list 1-D weights (norms, biases) too")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead")
    p.add_argument("--log-level", default="ERROR", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level of autopar's messages on stderr (default ERROR: the report says it all)")
    add_example_input_arguments(p)
    p.set_defaults(func=_run_coverage)
