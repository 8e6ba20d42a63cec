"""Every example in docs/ runs as written: python blocks print what their comments say, the
``autopar`` commands of shell blocks exit 0, and their ``torchrun`` launches train (``dist``).
How a page's blocks are read is in tests/doc_blocks.py."""
from __future__ import annotations

import re

import sys
from pathlib import Path

import pytest

from doc_blocks import assert_loss_falls, blocks, commands, printed_losses, promised, shell_runs, write_files

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = {path.name: blocks(path) for path in sorted(DOCS.glob("*.md"))}
PYTHON = [b for page in PAGES.values() for b in page if b.lang == "python" and not b.file]
SHELL = [(b, c) for page in PAGES.values() for b in page if b.lang == "bash" for c in commands(b)]
SHELL_IDS = [f"{b.id}-{c.split()[0]}{i}" for i, (b, c) in enumerate(SHELL)]


@pytest.fixture
def page_folder(tmp_path):
    """A fresh folder holding the page's ``# file:`` blocks."""
    def make(page: str) -> Path:
        write_files(PAGES[page], tmp_path)
        return tmp_path
    return make


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_example_runs(block, page_folder, monkeypatch, capsys):
    folder = page_folder(block.page)  # a fresh folder holding the page's files; what a block writes lands there
    monkeypatch.chdir(folder)
    files = [b.file for b in PAGES[block.page] if b.file]
    if files:  # the page's own modules, imported afresh
        monkeypatch.syspath_prepend(str(folder))
        for name in files:
            monkeypatch.delitem(sys.modules, name.removesuffix(".py"), raising=False)
    exec(compile(block.text, f"{block.page}[{block.index}]", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    for expected in promised(block):
        assert any(expected in line for line in printed), f"{block.page}: expected {expected!r} in {printed}"
    losses = printed_losses("\n".join(printed))
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
