"""A training script for torchrun, used by tests/runtime/test_faults.py.

Trains the equivalence harness's gpt_tiny case on ``--mesh``, resuming from ``--ckpt`` when a
checkpoint is there and saving one after every step. With ``--kill-step k``, on torchrun's first
attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1 dies with ``os._exit`` in the middle of writing the
checkpoint of step k+1, so torchrun restarts the job and it resumes from step k. With
``--sigkill-step k`` (and ``--run-dir``), rank 1 kills itself with SIGKILL inside its stage's forward
of microbatch 2 in step k (numbered from 1): the survivors write the job-wide diagnosis. Rank 0
appends every step's loss to ``--out``/losses.jsonl and saves the final weights to ``--out``/final.pt.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 tests/runtime/fault_train.py \\
        --mesh 1,2,1 --ckpt /tmp/ck --out /tmp/out --kill-step 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the harness

from equivalence import Case, batches, build, make_optimizer  # noqa: E402

CASE = Case(model="gpt_tiny", overrides=(("num_layers", 4),), steps=5)


def _die_mid_save(step: int) -> None:
    """On rank 1: exit the process abruptly while the checkpoint files of ``step`` are written."""
    import torch.distributed.checkpoint as dcp

    original = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        original(self, plan, planner)
        os._exit(17)

    dcp.FileSystemWriter.write_data = write_then_die


def _sigkill_in_forward(program, step: int) -> None:
    """On the last stage's rank: SIGKILL itself inside the forward of microbatch 2 in ``step``."""
    import signal
    gm = program.stages[max(program.stages)].gm
    forward = gm.forward

    def dying(*args, **kwargs):
        if program.step_count + 1 == step and program.channel.microbatch == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(*args, **kwargs)

    gm.forward = dying


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default="1,2,1")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--sigkill-step", type=int, default=-1)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import autopar
    from autopar.models import lm_loss
    dp, pp, tp = (int(x) for x in args.mesh.split(","))
    mesh = autopar.init_mesh(dp=dp, pp=pp, tp=tp, backend="gloo")
    model = build(CASE)
    data = batches(CASE, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(CASE), p2p_timeout_s=120,
                              run_dir=args.run_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = program.info.rank
    if rank == 1 and args.sigkill_step > 0:
        _sigkill_in_forward(program, args.sigkill_step)
    start = program.load_checkpoint(args.ckpt) if os.path.exists(os.path.join(args.ckpt, "latest")) else 0
    for step in range(start, CASE.steps):
        x, y = data[step]
        loss = program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()
        if rank == 0:
            with open(os.path.join(args.out, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step, "loss": loss, "start": start}) + "\n")
        if attempt == 0 and rank == 1 and step == args.kill_step:
            _die_mid_save(step + 1)
        program.save_checkpoint(args.ckpt)
    state = program.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "attempt": attempt, "start": start}, os.path.join(args.out, "final.pt"))
    torch.distributed.destroy_process_group()  # a group left to the interpreter's exit can abort in gloo's threads


if __name__ == "__main__":
    main()
