"""Every example in docs/ runs as written and prints what its page shows: python blocks' output is
compared line by line with the page (a ``text`` fence after the block, a ``print(x)  # text`` comment),
as doctest compares; the ``autopar`` commands of shell blocks exit 0 (and print their output fence), their
``torchrun`` launches train (``dist``); a block the tests do not run says why on the page. How a page's
fences are read is in tests/doc_blocks.py."""
from __future__ import annotations

import re

import sys
from pathlib import Path

import pytest

from doc_blocks import (assert_loss_falls, blocks, command_lines, commands, fences, output_mismatch, printed_losses,
                        printed_problems, run_python, shell_runs, write_files)

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = {path.name: blocks(path) for path in sorted(DOCS.glob("*.md"))}
FENCES = {path.name: fences(path) for path in sorted(DOCS.glob("*.md"))}
PYTHON = [b for page in PAGES.values() for b in page if b.lang == "python" and not b.file and not b.not_run]
SHELL = [(b, c) for page in PAGES.values() for b in page if b.lang == "bash" for c in commands(b)]
SHELL_IDS = [f"{b.id}-{c.split()[0]}{i}" for i, (b, c) in enumerate(SHELL)]


@pytest.fixture
def page_folder(tmp_path):
    """A fresh folder holding the page's ``# file:`` blocks."""
    def make(page: str) -> Path:
        write_files(PAGES[page], tmp_path)
        return tmp_path
    return make


@pytest.mark.parametrize("page", list(FENCES))
def test_every_code_block_runs_or_says_why(page):
    """Each fence names a language the tests know; a python or bash block runs, or its first line says why not
    (``# not run: <reason>``); a ``# file:`` block is imported or launched by another block of its page."""
    problems = []
    for block in FENCES[page]:
        if not block.lang:
            problems.append(f"fence {block.index} is tagged {block.tag!r}: tag it python, bash or text")
        elif block.lang == "bash" and not block.not_run:
            idle = [c for c in command_lines(block) if c not in commands(block)]
            if idle:
                problems.append(f"bash block {block.index} has commands the tests do not run: {idle}; "
                                "start the block with '# not run: <reason>'")
        elif block.lang == "python" and block.file:
            stem = block.file.removesuffix(".py")
            users = [b for b in FENCES[page] if b is not block and re.search(rf"\b{re.escape(stem)}\b", b.text)]
            if not users:
                problems.append(f"file block {block.file} is neither imported nor launched by another block")
    assert not problems, f"{page}: " + "; ".join(problems)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_example_prints_what_the_page_shows(block, page_folder, monkeypatch, capsys):
    folder = page_folder(block.page)  # a fresh folder holding the page's files; what a block writes lands there
    monkeypatch.chdir(folder)
    files = [b.file for b in PAGES[block.page] if b.file]
    if files:  # the page's own modules, imported afresh
        monkeypatch.syspath_prepend(str(folder))
        for name in files:
            monkeypatch.delitem(sys.modules, name.removesuffix(".py"), raising=False)
    records = run_python(block, f"{block.page}[{block.index}]")
    problems = printed_problems(block, records)
    assert not problems, f"{block.page}[{block.index}]:\n" + "\n".join(problems)
    losses = printed_losses("".join(text for _, text in records))
    if len(losses) >= 2:  # a block that trains and prints its losses: they must fall
        assert_loss_falls(losses, where=f"{block.page}[{block.index}]")


def _marks(command: str) -> list:
    """A torchrun launch is ``dist``; one of more than 2 processes also ``slow`` (tests/case_marks.py)."""
    if not command.startswith("torchrun"):
        return []
    procs = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", command)
    return [pytest.mark.dist] + ([pytest.mark.slow] if procs and int(procs.group(1)) > 2 else [])


@pytest.mark.parametrize("block,command", [pytest.param(b, c, marks=_marks(c)) for b, c in SHELL], ids=SHELL_IDS)
def test_shell_example_runs(block, command, page_folder):
    files = tuple((b.file, b.text) for b in PAGES[block.page] if b.file)
    done = shell_runs(command, page_folder(block.page), files)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if command.startswith(("torchrun", "autopar train")):  # a training run: its printed loss must fall
        assert_loss_falls(printed_losses(done.stdout), where=f"{block.page}: {command}")
    if block.output is not None:  # the page shows what the command prints
        assert len(commands(block)) == 1, f"{block.id}: an output fence after a block of several commands"
        diff = output_mismatch(block.output, done.stdout)
        assert diff is None, f"{block.page}: {command}\n{diff}"
