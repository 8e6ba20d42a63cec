"""Run pytest many times in a row without paying torch's import each time: a server imports the test
dependencies once and forks a fresh child per run; the child imports autopar from this checkout's source.

    python tests/tools/fork_pytest.py --serve /tmp/s.sock &          # once
    python tests/tools/fork_pytest.py --socket /tmp/s.sock -- tests/runtime/test_item_count.py -q

The client exits with the child's pytest exit status (a child killed by a signal, the run's timeout
included, gives 128 + the signal). The mutation run (tests/tools/mutation.py) uses it as cosmic-ray's test
command: each mutant is written into a module, and a child that has never imported autopar reads it.

The server never imports autopar: its finder (``CheckoutFinder``) maps the packages of pyproject's
``[tool.setuptools.package-dir]`` onto this checkout, whichever checkout the installed editable autopar
points at, so a copy of the repository can be mutated while its original is worked on.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import json
import os
import signal
import socket
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: imported once by the server (the costly part of a test process); never autopar itself
PRELOAD = ("torch", "torch.distributed", "torch.distributed.device_mesh", "torch.fx", "torch.export",
           "torch.testing", "torch.testing._internal.distributed.fake_pg", "torch.nn.functional", "numpy", "sympy",
           "networkx", "pydantic", "pytest", "hypothesis", "hypothesis.strategies")


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``autopar`` and its mapped packages (``autopar.runtime`` -> ``runtime/``) in one checkout."""

    def __init__(self, root: Path):
        dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        self.packages = {name: root / folder for name, folder in dirs.items()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.packages:
            folder = self.packages[fullname]
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
        return None


def _child(args: list[str], timeout: float, log: Path) -> None:
    """In the forked child: the run's output to ``log``, pytest over ``args``, exit with its status."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(timeout)))
    code = 3
    try:
        import pytest
        code = int(pytest.main(args))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_one(conn: socket.socket, log: Path) -> None:
    request = json.loads(conn.makefile("r").readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request["args"], request["timeout"], log)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
    except OSError:
        pass  # the client gave up (its own timeout): nothing to tell


def serve(path: Path) -> None:
    """Import the dependencies, then fork one child per request, one at a time, until killed."""
    sys.dont_write_bytecode = True
    os.chdir(ROOT)
    sys.meta_path.insert(0, CheckoutFinder(ROOT))
    for name in PRELOAD:
        importlib.import_module(name)
    assert not any(m == "autopar" or m.startswith("autopar.") for m in sys.modules), "the server imported autopar"
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(4)
        while True:
            conn, _ = server.accept()
            with conn:
                _run_one(conn, path.with_suffix(".log"))


def request(path: Path, args: list[str], *, timeout: float) -> int:
    """Ask the server at ``path`` for one pytest run; its exit status."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        conn.sendall((json.dumps({"args": args, "timeout": timeout}) + "\n").encode())
        return int(conn.makefile("r").readline() or 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=Path, help="serve on this unix socket until killed")
    parser.add_argument("--socket", type=Path, help="the server's socket, for one run of the pytest args")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the child is killed")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    if not args.socket:
        parser.error("--serve or --socket is needed")
    return request(args.socket, args.pytest_args, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
