"""The code blocks of a Markdown page, as the doc tests run them.

- A ```` ```python ```` block runs in the test process; a ``print(x)  # text`` line promises that
  ``text`` appears in what the block prints.
- A python block whose first line is ``# file: NAME`` is a file the reader saves (a model, a
  training script): it is written to the page's working folder before any block runs, and it
  runs only when another block imports or launches it.
- In a ```` ```bash ```` block, each command that starts with ``autopar`` or ``torchrun`` runs as
  written, in that folder (backslash continuations joined, ``#`` comments dropped); other
  commands (``pip install``, ``python -m pytest``) are the newcomer's set-up, checked elsewhere.
"""
from __future__ import annotations

import io
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "blocks", "write_files", "commands", "run_command", "promised", "free_port", "shell_runs",
           "printed_losses", "assert_loss_falls"]

_FENCE = re.compile(r"^```(python|bash|sh|shell)\n(.*?)^```", flags=re.S | re.M)
_FILE = re.compile(r"^# file: (\S+)")
RUNNABLE = ("autopar", "torchrun")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, text, and the file name it is saved as (if any)."""

    page: str
    index: int
    lang: str
    text: str

    @property
    def file(self) -> str | None:
        match = _FILE.match(self.text)
        return match.group(1) if match and self.lang == "python" else None

    @property
    def id(self) -> str:
        return f"{self.page}-{self.index}"


def blocks(path: Path) -> list[Block]:
    """Every python and shell block of ``path``, numbered in page order."""
    found = _FENCE.findall(path.read_text())
    return [Block(path.name, i, "python" if lang == "python" else "bash", text) for i, (lang, text) in enumerate(found)]


def write_files(page_blocks: list[Block], folder: Path) -> None:
    """Save the page's ``# file:`` blocks into ``folder``."""
    for block in page_blocks:
        if block.file:
            (folder / block.file).write_text(block.text)


def commands(block: Block) -> list[str]:
    """The ``autopar`` / ``torchrun`` commands of a shell block."""
    text = re.sub(r"\\\n\s*", " ", block.text)
    lines = [line.split(" #", 1)[0].strip() for line in text.splitlines()]
    return [line for line in lines if line.split(" ", 1)[0] in RUNNABLE]


def promised(block: Block) -> list[str]:
    """The texts a python block's ``print(...)  # text`` comments promise (a ``#`` inside a string is no comment)."""
    lines = block.text.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(block.text).readline)
    return [tok.string[1:].strip() for tok in tokens
            if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("print(")]


def printed_losses(text: str) -> list[float]:
    """The losses a training run printed: ``step N: loss X`` lines, or ``loss X -> Y`` (first and last).
    Any token is parsed, so ``nan`` and ``inf`` are read (and then fail :func:`assert_loss_falls`)."""
    steps = [float(x) for x in re.findall(r"step \d+: loss (\S+)", text)]
    if steps:
        return steps
    return [float(x) for pair in re.findall(r"loss (\S+) -> (\S+)", text) for x in pair]


def assert_loss_falls(losses: list[float], *, where: str) -> None:
    """Every loss finite and the last below the first (the run trained)."""
    assert len(losses) >= 2, f"{where}: no loss trace printed"
    assert all(math.isfinite(x) for x in losses), f"{where}: a loss is not finite: {losses}"
    assert losses[-1] < losses[0], f"{where}: the loss did not fall: {losses}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MODULES = {"autopar": "autopar", "torchrun": "torch.distributed.run"}


def _path(folder: Path) -> str:
    """PATH with this interpreter's scripts first; where pip put them elsewhere (a --user install),
    a shim in ``folder/.bin`` runs ``python -m`` the same module instead."""
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    missing = [name for name in _MODULES if shutil.which(name, path=path) is None]
    if missing:
        shims = folder / ".bin"
        shims.mkdir(exist_ok=True)
        for name in missing:
            shim = shims / name
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {_MODULES[name]} "$@"\n')
            shim.chmod(0o755)
        path = str(shims) + os.pathsep + path
    return path


def run_command(command: str, folder: Path, *, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``command`` with bash in ``folder``, this interpreter's scripts first on PATH, torchrun on a free port."""
    env = dict(os.environ, PATH=_path(folder), OMP_NUM_THREADS="1",
               PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(free_port()))
    return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)



_RUNS: dict = {}  # (command, page files) -> result, for this test session


def shell_runs(command: str, folder: Path, files: tuple = ()) -> subprocess.CompletedProcess:
    """:func:`run_command`, once per test session for the same command and page files (the README and a
    doc page may show the same command)."""
    key = (command, files)
    if key not in _RUNS:
        _RUNS[key] = run_command(command, folder)
    return _RUNS[key]
