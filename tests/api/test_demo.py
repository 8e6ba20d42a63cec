"""``python -m autopar.demo`` spawns its own ranks, trains, and prints a finite, falling loss."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from doc_blocks import assert_loss_falls


@pytest.mark.dist
@pytest.mark.parametrize("mesh,shown", [
    ("dp=1,pp=2,tp=1", "dp=1 x pp=2 x tp=1"),
    pytest.param("dp=1,cp=2", "dp=1 x cp=2 x pp=1 x tp=1", marks=pytest.mark.slow),  # context parallelism
])
def test_demo_spawns_trains_and_reports_the_loss(mesh, shown):
    argv = [sys.executable, "-m", "autopar.demo", "--mesh", mesh, "--steps", "4", "--layers", "2",
            "--hidden", "32", "--seq-len", "32", "--batch", "8", "--no-progress", "--timeout", "60"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # spawn mode, not torchrun
    done = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Plan for GPT: {shown} = 2 ranks" in done.stdout
    if "cp=2" in mesh:
        assert "context parallel: the sequence cut over cp=2" in done.stdout
    match = re.search(rf"^done: 4 steps on {re.escape(shown)} .* loss (\S+) -> (\S+)$", done.stdout, flags=re.M)
    assert match, done.stdout
    assert_loss_falls([float(match[1]), float(match[2])], where="python -m autopar.demo")


def test_demo_reports_a_bad_mesh_without_spawning():
    done = subprocess.run([sys.executable, "-m", "autopar.demo", "--mesh", "dp=two"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "autopar train: error: mesh degree dp='two'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.dist
def test_demo_prints_one_rank_error_once_and_exits_2():
    argv = [sys.executable, "-m", "autopar.demo", "--mesh", "dp=2", "--batch", "3", "--layers", "1",
            "--hidden", "32", "--seq-len", "16", "--steps", "1", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("autopar train: error on rank ")]
    assert len(errors) == 1 and "not divisible by dp=2" in errors[0] and "Fix:" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
