"""The code blocks of a Markdown page, as the doc tests run them.

Every fence of a page names its language: ``python`` (or ``py``), ``bash``, or ``text`` (an
illustration: a diagram, a folder tree, or the output of the block before it).

- A python block runs in the test process. Its output is compared line by line with what the page
  says it prints, as doctest compares (``...`` in an expected line matches any text, as doctest's
  ELLIPSIS): a ```` ```text ```` fence that follows it (only blank lines, or one paragraph ending in
  ``:``, in between) is its whole output; and a ``print(x)  # text`` comment is the exact output of
  that print call. A block that prints what the page does not show fails.
- A python block whose first line is ``# file: NAME`` is a file the reader saves (a model, a
  training script): it is written to the page's working folder before any block runs, and it
  runs when another block imports or launches it (another block must).
- In a ```` ```bash ```` block, each command that starts with ``autopar`` or ``torchrun`` runs as
  written, in that folder (backslash continuations joined, ``#`` comments dropped); a text fence
  after a block of one command is that command's output, compared as above.
- A python or bash block that the tests do not run says so on its first line, with the reason:
  ``# not run: <why>`` (a sketch with ``...`` in it, an install line, a 1,024-GPU job).
"""
from __future__ import annotations

import doctest
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

__all__ = ["Block", "blocks", "fences", "write_files", "commands", "command_lines", "print_calls", "run_command", "promised", "free_port",
           "shell_runs", "printed_losses", "assert_loss_falls", "output_mismatch", "LANGS"]

_ANY_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)
_FILE = re.compile(r"^# file: (\S+)")
_NOT_RUN = re.compile(r"^# not run: (\S.*)")
RUNNABLE = ("autopar", "torchrun")
LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "text": "text"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, text, the output fence after it (if any)."""

    page: str
    index: int
    lang: str
    text: str
    output: str | None = None  # the text fence that shows what this block prints
    tag: str = ""  # the fence's language as written

    @property
    def file(self) -> str | None:
        match = _FILE.match(self.text)
        return match.group(1) if match and self.lang == "python" else None

    @property
    def not_run(self) -> str | None:
        """The reason the page gives for not running this block, or None."""
        match = _NOT_RUN.match(self.text)
        return match.group(1).strip() if match else None

    @property
    def id(self) -> str:
        return f"{self.page}-{self.index}"


def _is_output_gap(between: str) -> bool:
    """Whether the text between a code fence and a text fence makes the text fence its output."""
    gap = between.strip()
    return not gap or ("\n\n" not in gap and "```" not in gap and gap.endswith(":"))


def fences(path: Path) -> list[Block]:
    """Every fence of ``path`` in page order (any language; ``lang`` "" when its tag is not a known one)."""
    text = path.read_text()
    found, previous_end = [], None
    for i, match in enumerate(_ANY_FENCE.finditer(text)):
        tag = match.group(1).strip()
        found.append((Block(path.name, i, LANGS.get(tag, ""), match.group(2), tag=tag),
                      text[previous_end:match.start()] if previous_end is not None else None))
        previous_end = match.end()
    out = []
    for k, (block, _) in enumerate(found):
        following = found[k + 1] if k + 1 < len(found) else None
        if block.lang in ("python", "bash") and following is not None and following[0].lang == "text" \
                and _is_output_gap(following[1]):
            block = Block(block.page, block.index, block.lang, block.text, output=following[0].text, tag=block.tag)
        out.append(block)
    return out


def blocks(path: Path) -> list[Block]:
    """Every python and shell block of ``path``, numbered in page order of all its fences."""
    return [b for b in fences(path) if b.lang in ("python", "bash")]


def output_mismatch(expected: str, got: str) -> str | None:
    """None when ``got`` is ``expected`` line by line (``...`` matching any text, as doctest's ELLIPSIS;
    trailing spaces of a line ignored); else doctest's report of the difference."""
    want = "".join(line.rstrip() + "\n" for line in expected.splitlines())
    have = "".join(line.rstrip() + "\n" for line in got.splitlines())
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.REPORT_NDIFF
    if checker.check_output(want, have, flags):
        return None
    return checker.output_difference(doctest.Example("", want), have, flags)


def write_files(page_blocks: list[Block], folder: Path) -> None:
    """Save the page's ``# file:`` blocks into ``folder``."""
    for block in page_blocks:
        if block.file:
            (folder / block.file).write_text(block.text)


def command_lines(block: Block) -> list[str]:
    """Every command of a shell block (backslash continuations joined, comments and blank lines dropped)."""
    text = re.sub(r"\\\n\s*", " ", block.text)
    lines = [line.split(" #", 1)[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def commands(block: Block) -> list[str]:
    """The ``autopar`` / ``torchrun`` commands of a shell block (none when the block is marked not run)."""
    if block.not_run:
        return []
    return [line for line in command_lines(block) if line.split(" ", 1)[0] in RUNNABLE]


def promised(block: Block) -> dict[int, str]:
    """{line of a ``print(`` call: the text its ``# text`` comment promises} (a ``#`` in a string is no comment;
    the comment may stand on the call's first or last line)."""
    import ast
    comments = {tok.start[0]: tok.string[1:].strip()
                for tok in tokenize.generate_tokens(io.StringIO(block.text).readline) if tok.type == tokenize.COMMENT}
    calls = [n for n in ast.walk(ast.parse(block.text))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]
    out = {}
    for call in calls:
        for line in (call.lineno, call.end_lineno):
            if line in comments:
                out[call.lineno] = comments[line]
                break
    return out


def print_calls(block: Block) -> list[tuple[int, int]]:
    """(first line, last line) of every ``print(`` call of a python block."""
    import ast
    return [(n.lineno, n.end_lineno) for n in ast.walk(ast.parse(block.text))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]


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


def run_python(block: Block, name: str) -> list[tuple[int, str]]:
    """Run a python block; (first line of the ``print`` call, the text it printed) for every print it ran."""
    calls = print_calls(block)
    records: list[tuple[int, str]] = []

    def recorder(*args, sep=" ", end="\n", file=None, flush=False):
        if file is not None and file is not sys.stdout:
            return print(*args, sep=sep, end=end, file=file, flush=flush)
        line = sys._getframe(1).f_lineno
        first = next((a for a, b in calls if a <= line <= b), line)
        text = sep.join(str(a) for a in args) + end
        records.append((first, text))
        sys.stdout.write(text)

    exec(compile(block.text, name, "exec"), {"print": recorder, "__name__": "__doc__"})
    return records


def printed_problems(block: Block, records: list[tuple[int, str]]) -> list[str]:
    """What a python block printed that differs from what its page shows (see the module doc)."""
    problems = []
    if block.output is not None:
        diff = output_mismatch(block.output, "".join(text for _, text in records))
        if diff is not None:
            problems.append(f"the output fence after the block does not match what it printed:\n{diff}")
    promises = promised(block)
    for line, text in records:
        if line in promises:
            diff = output_mismatch(promises[line], text)
            if diff is not None:
                problems.append(f"line {line}: print promises {promises[line]!r}, printed {text!r}")
        elif block.output is None:
            problems.append(f"line {line} prints {text!r}, which the page does not show")
    return problems
