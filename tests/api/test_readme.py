"""The README's usage examples run as written and print what the README shows: each python block and each
``autopar`` command is followed by a ``text`` fence of its output, compared line by line as doctest compares
(``...`` matching any text; tests/doc_blocks.py), the same comparison docs/ gets from
tests/api/test_docs_examples.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import (assert_loss_falls, blocks, command_lines, commands, fences, output_mismatch, printed_losses, printed_problems,
                        run_python, shell_runs)

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list:
    """The README's python blocks, each with the output fence that follows it."""
    found = [b for b in blocks(README) if b.lang == "python"]
    assert len(found) == 2, f"the README has {len(found)} python blocks; these tests run two"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_training_script_runs_under_torchrun(tmp_path):
    block = _python_blocks()[0]
    assert "torchrun --nproc-per-node 4" in block.text
    assert block.output is not None, "the README shows no output after its training script"
    path = tmp_path / "train.py"
    path.write_text(block.text)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    diff = output_mismatch(block.output, proc.stdout)
    assert diff is None, f"README training script:\n{diff}"
    losses = printed_losses(proc.stdout)
    assert len(losses) == 5, proc.stdout[-3000:]
    assert_loss_falls(losses, where="README training script")  # 5 AdamW steps on text


def test_plan_example_prints_what_the_readme_shows(capsys):
    block = _python_blocks()[1]
    assert block.output is not None, "the README shows no output after its plan example"
    records = run_python(block, "README-plan-example")
    problems = printed_problems(block, records)
    assert not problems, "README plan example:\n" + "\n".join(problems)


def test_readme_shell_commands_print_what_the_readme_shows(tmp_path):
    """Every `autopar ...` command of the README's shell blocks exits 0 and prints the text fence after it (each
    stands in a block of its own; the install lines are checked by CI)."""
    runnable = [b for b in blocks(README) if b.lang == "bash" and commands(b)]
    assert any(c.startswith("autopar inspect") for b in runnable for c in commands(b))
    for block in runnable:
        assert len(commands(block)) == 1, f"README block {block.index}: one command per block, then its output"
        assert block.output is not None, f"README block {block.index}: no output fence after {commands(block)[0]!r}"
        command = commands(block)[0]
        done = shell_runs(command, tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        diff = output_mismatch(block.output, done.stdout)
        assert diff is None, f"{command}\n{diff}"


def test_every_readme_block_runs_or_says_why():
    """Each fence names a language the tests know, and a bash block whose lines the tests do not run says why
    on its first line (``# not run: <reason>``), as docs/ pages do."""
    problems = []
    for block in fences(README):
        if not block.lang:
            problems.append(f"fence {block.index} is tagged {block.tag!r}: tag it python, bash or text")
        elif block.lang == "bash" and not block.not_run:
            idle = [c for c in command_lines(block) if c not in commands(block)]
            if idle:
                problems.append(f"bash block {block.index} has commands the tests do not run: {idle}")
    assert not problems, "README: " + "; ".join(problems)


def test_readme_names_the_pinned_transformers_and_installs_the_pins():
    """The README's test command installs constraints.txt, and the transformers version it names is the pinned one."""
    text = README.read_text()
    pins = dict(line.split("==", 1) for line in (README.parent / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert 'pip install -e ".[test]" -c constraints.txt' in text
    assert f"transformers {pins['transformers']}" in text
    assert "torch" not in pins  # the README and .ci/run install torch==2.13.0 themselves
