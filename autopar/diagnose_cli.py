"""``autopar diagnose RUN_DIR``: print the job-wide diagnosis of a run from its files.

A run compiled with ``run_dir=RUN_DIR`` leaves there each rank's flight record (``flight/rank<R>.bin``)
and, when a rank lived to write it, the diagnosis (``diagnosis.json``, ``diagnosis.txt``). This
command prints the same report the ranks logged, rebuilt from ``diagnosis.json`` (or, on a host
where only ``diagnosis.txt`` was written, that); when no rank wrote one (every process was
killed), it reads the flight files alone (docs/errors.md).

    autopar diagnose /scratch/run7
"""
from __future__ import annotations

import argparse
import os

from autopar.errors import InputError

__all__ = ["add_diagnose_command", "diagnose_text"]

_DESCRIPTION = """\
Print the job-wide diagnosis of a run: which ranks wait, on which collective or peer, what the
rank they wait on was last doing (or that it is gone), and where the ranks' collectives diverge.
RUN_DIR is the run_dir the program was compiled with (autopar.compile(..., run_dir=RUN_DIR))."""

_EPILOG = """\
examples:
  autopar diagnose /scratch/run7          the report a surviving rank wrote, or one rebuilt
                                          from the ranks' flight files (flight/rank<R>.bin)"""


def diagnose_text(run_dir: str) -> str:
    """The report of ``run_dir`` (raises InputError when it holds neither a diagnosis nor flight files)."""
    from autopar.runtime.diagnostics.diagnosis import read_run

    if not os.path.isdir(run_dir):
        raise InputError(f"{run_dir!r} is not a folder", where="autopar diagnose RUN_DIR",
                         fix="pass the run_dir the program was compiled with")
    report = read_run(run_dir)
    text = os.path.join(run_dir, "diagnosis.txt")
    if report is None and os.path.exists(text):  # written by a rank that took the report from another host
        with open(text, encoding="utf-8") as f:
            return f.read().rstrip("\n")
    if report is None:
        raise InputError(f"{run_dir!r} holds no diagnosis.json and no flight files (flight/rank<R>.bin)",
                         where="autopar diagnose RUN_DIR",
                         fix="compile with run_dir=RUN_DIR (and flight_record > 0) so the ranks write them")
    return report.text()


def _run(args: argparse.Namespace) -> int:
    print(diagnose_text(args.run_dir))
    return 0


def add_diagnose_command(sub) -> None:
    """Add ``autopar diagnose`` to the CLI's subcommands."""
    p = sub.add_parser("diagnose", help="print the job-wide diagnosis of a run that hung or lost a rank",
                       description=_DESCRIPTION, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir the program was compiled with")
    p.set_defaults(func=_run)
