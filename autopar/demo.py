"""Train a small GPT on the built-in text corpus over a dp x pp x tp mesh of CPU processes.

    python -m autopar.demo --mesh dp=1,pp=2,tp=2 --steps 60      # spawns its own 4 workers
    autopar train --mesh dp=2,pp=1,tp=2                            # the same, as a subcommand
    torchrun --nproc-per-node 4 -m autopar.demo --mesh dp=2,pp=2,tp=1   # or under torchrun

Started without torchrun's environment (RANK / WORLD_SIZE), it spawns one process per rank
itself (gloo on 127.0.0.1, a free port); under torchrun it uses the environment it is given.
Every rank builds the model from the same seed and reads the same global batches;
``program.shard_batch`` hands each rank its data-parallel slice. Rank 0 shows a progress bar
(loss, tokens/s) and prints the first and last loss.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from autopar.errors import AutoparError
from autopar.plan_model import MeshShape

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "run", "train", "main"]

log = logging.getLogger(__name__)

DEFAULT_MESH = "dp=1,pp=2,tp=2"

DESCRIPTION = """\
Train a small GPT (character-level, on docstrings of the Python standard library) with
autopar.compile on a dp x pp x tp mesh of CPU processes, one per rank (gloo). Without
torchrun's environment it spawns the processes itself; under torchrun it uses the ranks
torchrun started. Rank 0 shows a progress bar with the loss and tokens/s, then prints the
first and last loss. The defaults take about a minute on 2 CPU cores."""

EPILOG = """\
examples:
  autopar train                                         # dp=1,pp=2,tp=2, 4 processes
  autopar train --mesh dp=2,pp=2,tp=1 --schedule gpipe --microbatches 4 --steps 60
  python -m autopar.demo --mesh dp=1,pp=2,tp=1 --steps 4 --layers 2 --hidden 32
  torchrun --nproc-per-node 4 -m autopar.demo --mesh dp=2,pp=1,tp=2"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, shared by ``autopar train`` and ``python -m autopar.demo``."""
    from autopar.cli import add_schedule_arguments, positive_int

    parser.add_argument("--mesh", default=DEFAULT_MESH,
                        help=f"mesh degrees; their product is the number of processes (default {DEFAULT_MESH})")
    parser.add_argument("--steps", type=positive_int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--batch", type=positive_int, default=16, help="global batch size (default 16)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--hidden", type=positive_int, default=64, help="model width (default 64)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    add_schedule_arguments(parser)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds a rank waits for a pipeline peer before failing (default 300)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging level of every rank (default WARNING)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_logging(level: str, rank: int) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, force=True,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")


def train(args: argparse.Namespace, shape: MeshShape) -> dict:
    """This rank's training run (the process group is made here); rank 0's losses are returned."""
    import autopar
    from autopar.models import TextBatches, build_model, lm_loss

    rank = int(os.environ["RANK"])
    mesh = autopar.init_mesh(dp=shape.dp, pp=shape.pp, tp=shape.tp, backend="gloo")
    torch.manual_seed(args.seed)
    model = build_model("gpt_tiny", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                        seq_len=args.seq_len)
    batches = iter(TextBatches(seq_len=args.seq_len, batch_size=args.batch, seed=args.seed))
    x, y = next(batches)
    lr, t0 = args.lr, time.perf_counter()
    program = autopar.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                              optimizer=lambda params: torch.optim.AdamW(params, lr=lr), schedule=args.schedule,
                              num_microbatches=args.microbatches, num_virtual=args.virtual,
                              p2p_timeout_s=args.timeout)
    if rank == 0:
        print(f"{program.plan.summary()}\ncompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    losses, tokens, start = [], args.batch * args.seq_len, time.perf_counter()
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=rank != 0 or args.no_progress,
               dynamic_ncols=True, file=sys.stderr)
    for step in range(args.steps):
        if step:
            x, y = next(batches)
        t0 = time.perf_counter()
        loss = program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):,.0f}", refresh=False)
        bar.update()
        log.debug("step %d loss %.4f", step, loss)
    bar.close()
    elapsed = time.perf_counter() - start
    if rank == 0:
        verdict = "" if math.isfinite(losses[-1]) else "  (not finite!)"
        print(f"done: {args.steps} steps on {shape} ({shape.world_size} processes) in {elapsed:.1f} s, "
              f"{tokens * args.steps / elapsed:,.0f} tokens/s; loss {losses[0]:.4f} -> {losses[-1]:.4f}"
              f"{verdict}", flush=True)
    return {"losses": losses, "seconds": elapsed}


def _worker(local_rank: int, args: argparse.Namespace, shape: MeshShape, port: int) -> None:
    """One spawned rank: torchrun's environment by hand, then :func:`train`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(shape.world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(shape.world_size))
    _run_rank(args, shape)


def _run_rank(args: argparse.Namespace, shape: MeshShape) -> None:
    """Train on this rank; an autopar error is printed once (rank 0) and exits with status 2."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    _setup_logging(args.log_level, rank)
    try:
        train(args, shape)
    except AutoparError as exc:
        if rank == 0:
            print(f"autopar train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """Run the demo: as this torchrun rank, or by spawning one process per rank; returns the exit status."""
    from autopar.cli import parse_mesh

    shape = parse_mesh(args.mesh)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _run_rank(args, shape)
        return 0
    if shape.world_size == 1:
        _worker(0, args, shape, _free_port())
        return 0
    try:
        mp.start_processes(_worker, args=(args, shape, _free_port()), nprocs=shape.world_size,
                           start_method="spawn", join=True)
    except mp.ProcessExitedException as exc:
        return exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m autopar.demo``: parse the options and :func:`run`."""
    parser = argparse.ArgumentParser(prog="python -m autopar.demo", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except AutoparError as exc:
        print(f"autopar train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
