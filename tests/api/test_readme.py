"""The README's usage examples run as written."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import assert_loss_falls, blocks, commands, printed_losses, shell_runs

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_training_script_runs_under_torchrun(tmp_path):
    script = _python_blocks()[0]
    assert "torchrun --nproc-per-node 4" in script
    path = tmp_path / "train.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Plan for GPT" in proc.stdout
    losses = printed_losses(proc.stdout)
    assert len(losses) == 5, proc.stdout[-3000:]
    assert_loss_falls(losses, where="README training script")  # 5 AdamW steps on text


def test_plan_example_runs_in_a_plain_process(capsys):
    exec(compile(_python_blocks()[1], "README-plan-example", "exec"), {})
    out = capsys.readouterr().out
    assert "dp=2 x pp=2 x tp=2" in out
    assert "# rank 5: dp=1 pp=0 tp=1" in out
    assert "tp_reduce" in out and "send_" in out


def test_readme_shell_commands_run(tmp_path):
    """Every `autopar ...` command of the README's shell blocks exits 0 (the install lines are checked by CI)."""
    found = [c for b in blocks(README) if b.lang == "bash" for c in commands(b)]
    assert any(c.startswith("autopar inspect") for c in found)
    for command in found:
        done = shell_runs(command, tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        assert "Plan for" in done.stdout


def test_readme_names_the_pinned_transformers_and_installs_the_pins():
    """The README's test command installs constraints.txt, and the transformers version it names is the pinned one."""
    text = README.read_text()
    pins = dict(line.split("==", 1) for line in (README.parent / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert 'pip install -e ".[test]" -c constraints.txt' in text
    assert f"transformers {pins['transformers']}" in text
    assert "torch" not in pins  # the README and .ci/run install torch==2.13.0 themselves
