"""Train a small GPT on the built-in text corpus over a dp x pp x tp mesh of CPU processes.

    python -m autopar.demo --mesh dp=1,pp=2,tp=2 --steps 100      # spawns its own 4 workers
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
import tempfile
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from autopar.errors import AutoparError
from autopar.plan_model import MeshShape

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "run", "train", "main"]

log = logging.getLogger("autopar.demo")

DEFAULT_MESH = "dp=1,pp=2,tp=2"

DESCRIPTION = """\
Train a small GPT (character-level, on docstrings of the Python standard library) with
autopar.compile on a dp x pp x tp mesh of CPU processes, one per rank (gloo). Without
torchrun's environment it spawns the processes itself; under torchrun it uses the ranks
torchrun started. Rank 0 shows a progress bar with the loss and tokens/s, then prints the
first and last loss. The defaults take under a minute on 2 idle CPU cores."""

EPILOG = """\
examples:
  autopar train                                         # dp=1,pp=2,tp=2, 4 processes
  autopar train --mesh dp=2,pp=2,tp=1 --schedule gpipe --microbatches 4 --steps 100
  python -m autopar.demo --mesh dp=1,pp=2,tp=1 --steps 4 --layers 2 --hidden 32
  torchrun --nproc-per-node 4 -m autopar.demo --mesh dp=2,pp=1,tp=2"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, shared by ``autopar train`` and ``python -m autopar.demo``."""
    from autopar.cli_args import add_schedule_arguments, positive_int

    parser.add_argument("--mesh", default=DEFAULT_MESH,
                        help=f"mesh degrees; their product is the number of processes (default {DEFAULT_MESH})")
    parser.add_argument("--steps", type=positive_int, default=100, help="optimizer steps (default 100)")
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
                        format=f"[rank {rank} %(relativeCreated)6.0f ms] %(levelname)s %(name)s: %(message)s")


def train(args: argparse.Namespace, shape: MeshShape) -> dict:
    """This rank's training run (it makes the process group); returns the global loss of every step."""
    import autopar
    from autopar.models import TextBatches, build_model, lm_loss

    rank = int(os.environ["RANK"])
    mesh = autopar.init_mesh(dp=shape.dp, pp=shape.pp, tp=shape.tp, cp=shape.cp, backend="gloo")
    log.info("process group of %d ranks ready", shape.world_size)
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
    program.flush()  # an asynchronous pipeline's last backwards and sends, before the process group goes
    bar.close()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(_summary_line(losses, shape=shape, seconds=elapsed, tokens=tokens * args.steps), flush=True)
    return {"losses": losses, "seconds": elapsed}


def _summary_line(losses: list[float], *, shape: MeshShape, seconds: float, tokens: int) -> str:
    """``done: N steps on <mesh> (P processes) in S s, T tokens/s; loss FIRST -> LAST``."""
    procs = f"{shape.world_size} process" + ("es" if shape.world_size > 1 else "")
    warn = "" if math.isfinite(losses[-1]) else "  (the loss is not finite!)"
    return (f"done: {len(losses)} steps on {shape} ({procs}) in {seconds:.1f} s, {tokens / seconds:,.0f} tokens/s; "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}{warn}")


def _worker(local_rank: int, args: argparse.Namespace, shape: MeshShape, port: int, error_dir: str) -> None:
    """One spawned rank: torchrun's environment by hand, then :func:`train`; exits 2 on an autopar error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(shape.world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(shape.world_size))
    status = _run_rank(args, shape, error_dir=error_dir)
    if status:
        sys.exit(status)


def _run_rank(args: argparse.Namespace, shape: MeshShape, *, error_dir: str | None = None) -> int:
    """Train on this rank; returns 0, or 2 after an autopar error (printed, or left in ``error_dir``)."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    _setup_logging(args.log_level, rank)
    try:
        train(args, shape)
        return 0
    except AutoparError as exc:
        if error_dir is None:
            print(f"autopar train: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        else:  # the spawning parent prints one rank's message, not world_size copies
            path = os.path.join(error_dir, f"{rank:05d}")
            with open(path + ".tmp", "w") as f:
                f.write(f"error on rank {rank}: {exc}")
            os.replace(path + ".tmp", path + ".txt")
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_error(error_dir: str) -> str | None:
    """The message of the lowest rank that reported an autopar error, if any did."""
    names = sorted(n for n in os.listdir(error_dir) if n.endswith(".txt"))
    if not names:
        return None
    with open(os.path.join(error_dir, names[0])) as f:
        return f.read()


def run(args: argparse.Namespace) -> int:
    """Run the demo: as this torchrun rank, or by spawning one process per rank; returns the exit status."""
    from autopar.cli_args import parse_mesh

    shape = parse_mesh(args.mesh)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_rank(args, shape)
    if shape.world_size == 1:  # one rank: train in this process (the environment is restored after)
        with mock.patch.dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                             WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"):
            return _run_rank(args, shape)
    with tempfile.TemporaryDirectory(prefix="autopar-demo-") as error_dir:
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)  # not "Terminating process ..." for every rank after one failed
        try:
            mp.start_processes(_worker, args=(args, shape, _free_port(), error_dir), nprocs=shape.world_size,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException as exc:
            message = _first_error(error_dir)
            if message is None:
                raise
            print(f"autopar train: {message}", file=sys.stderr, flush=True)
            return exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1
        finally:
            spawn_log.setLevel(level)
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
