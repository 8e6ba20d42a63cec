"""Faults: a worker killed mid-run under torchrun, a two-node launch, a p2p wait that times out,
and a NaN in the loss or the gradients.

The torchrun tests launch tests/runtime/fault_train.py on 127.0.0.1 and judge it against one
device with the equivalence harness; the others are spawned cases of tests/shared_groups.py.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from equivalence import assert_equivalent, reference_run

import shared_groups as groups

pytestmark = pytest.mark.dist

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_train.py")
sys.path.insert(0, os.path.dirname(__file__))  # fault_train's CASE
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _judge(out, *, started_at: int | None = None):
    from fault_train import CASE
    lines = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    final = torch.load(out / "final.pt", weights_only=False)
    latest = {}
    for line in lines:  # a retried step's loss replaces the one of the attempt that died
        latest[line["step"]] = line["loss"]
    result = {"losses": [latest[s] for s in range(CASE.steps)], "state": final["state"]}
    assert_equivalent(CASE, result, reference_run(CASE))
    return lines, final


def test_killed_worker_resumes_from_the_last_checkpoint(tmp_path):
    """Rank 1 dies while writing step 3's checkpoint; torchrun restarts both ranks, they resume from
    step 2's checkpoint, and the run ends where an uninterrupted one does."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    cmd = _torchrun("--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                    SCRIPT, "--mesh", "1,2,1", "--ckpt", str(ckpt), "--out", str(out), "--kill-step", "2")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    lines, final = _judge(out)
    assert final["attempt"] == 1 and final["start"] == 2
    assert [(x["attempt"], x["step"]) for x in lines] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3), (1, 4)]
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step_"))[-1] == "step_00000005"


def test_two_node_launch_trains_like_one_device(tmp_path):
    """Two torchrun agents (nodes 0 and 1, one rank each, static rendezvous on 127.0.0.1), pp=2
    across them."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    port = str(_free_port())
    procs = [subprocess.Popen(
        _torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                  "--master-port", port, SCRIPT, "--mesh", "1,2,1", "--ckpt", str(ckpt), "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1][-4000:] for o in outputs)
    lines, final = _judge(out)
    assert final["attempt"] == 0 and len(lines) == 5


@pytest.mark.slow  # a torchrun launch of its own; tests/runtime/test_flight_faults.py covers SIGKILL by default
def test_a_rank_killed_under_torchrun_is_named_by_the_survivor_before_torchrun_stops_it(tmp_path):
    """Rank 1 dies by SIGKILL in its forward of microbatch 2 in step 2; torchrun SIGTERMs rank 0 at once,
    and rank 0 still writes the diagnosis (its SIGTERM waits for it) naming rank 1, gone, and the action."""
    ckpt, out, run_dir = tmp_path / "ckpt", tmp_path / "out", tmp_path / "run"
    out.mkdir()
    cmd = _torchrun("--nproc-per-node", "2", "--max-restarts", "0", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", SCRIPT, "--mesh", "1,2,1", "--ckpt", str(ckpt),
                    "--out", str(out), "--run-dir", str(run_dir), "--sigkill-step", "2")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert run.returncode != 0
    text = (run_dir / "diagnosis.txt").read_text()
    assert "culprit: rank 1: it is gone (no heartbeat for" in text, text + run.stderr[-4000:]
    assert "its last action: 1F2 (stage 1, microbatch 2), step 2" in text
    assert "job-wide diagnosis (made by rank 0; rank 0 logs it)" in run.stderr


def _result(case):
    result = groups.result(case)
    assert "error" not in result, f"{case.name()}:\n{result.get('traceback', result['error'])}"
    return result


def test_p2p_wait_that_times_out_names_rank_stage_action_and_peer():
    """Stage 0 skips its step: stage 1's receive gives up after p2p_timeout_s instead of hanging."""
    messages = _result(groups.P2P_TIMEOUT)["messages"]
    assert messages[0] == ""
    text = messages[1]
    assert "waiting for the activation of edge 0, microbatch 0" in text
    assert "rank 1, stage 1, action 1F0, peer rank 0 (stage 0)" in text
    assert "p2p_timeout_s" in text


def test_nan_in_loss_or_gradients_names_step_and_stage():
    out = _result(groups.NONFINITE)
    # a weight set to inf on stage 0: the loss of step 2 is NaN (reported first, from the last stage)
    assert "non-finite value at training step 2: the loss of microbatch" in out["loss"]
    assert "(stage 1)" in out["loss"] and "rank 1" in out["loss"]
    # a loss that is finite but whose gradient is NaN: caught before the optimizer steps
    assert "training step 1: the gradient of" in out["grad"] and "(stage " in out["grad"]
    assert out["unchanged"] and out["step_count"] == 0


@pytest.mark.timing  # wall-clock bounds: skipped by default (tests/conftest.py), run with -m timing
def test_collective_timeout_waits_its_2_s_and_not_much_longer():
    """The RuntimeCommError comes after p2p_timeout_s (2 s), well before the groups' 20 s gloo timeout."""
    out = _result(groups.COLLECTIVE_TIMEOUT)
    for axis in ("dp", "tp"):
        (_, seconds), _ = out[axis]
        assert 2.0 <= seconds < 12.0, (axis, seconds)


def test_collective_that_times_out_names_rank_collective_and_group():
    """Rank 1 skips its step: rank 0's first dp all-reduce (dp=2, the step's token count), its gradient
    reduction (rank 1 stops after the batch agreement) and its tp all-reduce inside the forward (tp=2) each
    give up after p2p_timeout_s (2 s) with a RuntimeCommError, on groups the user made
    (DeviceMesh.from_group), long before the groups' own 20 s gloo timeout."""
    out = _result(groups.COLLECTIVE_TIMEOUT)
    for axis in ("dp", "dp_grads", "tp"):
        (text, seconds), (other, _) = out[axis]
        assert other == ""
        assert "did not complete within 2 s" in text and "Operation timed out" in text
        assert "Where: rank 0, stage 0" in text and "over ranks [0, 1]" in text
        assert "p2p_timeout_s" in text and "resume from the last checkpoint" in text
    dp_text, tp_text = out["dp"][0][0], out["tp"][0][0]
    # lm_loss is a token mean: the step's first dp collective sums its target tokens (runtime/execution/item_count.py)
    assert "the all_reduce (the step's target tokens" in dp_text and "agreeing on the step's rows and tokens" in dp_text
    # a loss that is no token mean: rank 1 joins the step's batch agreement (runtime/execution/batch_agreement.py) and
    # stops, so rank 0's own gradient reduction times out, and the job-wide diagnosis names rank 1 at the agreement
    grads_text = out["dp_grads"][0][0]
    assert "(grad_reduce) did not complete within 2 s" in grads_text
    assert "gradient sync after the schedule" in grads_text
    assert "culprit rank 1" in grads_text and "the step's rows on every dp rank" in grads_text
    assert "the all_reduce (TpReduce node" in tp_text and "(mesh axis tp)" in tp_text and "action 0F0" in tp_text
