"""Spawn a small gloo process group on 127.0.0.1 and bring rank 0's result back.

Every benchmark body is a module-level function ``body(rank, world_size, *args) -> picklable``.
:func:`spawn` starts ``world_size`` processes (start method "spawn", one CPU thread each, so
two ranks on a 2-core machine do not fight over cores), initialises the default gloo process
group on a free local port, runs the body in every rank and returns what rank 0 returned.

Example::

    >>> from _spawn import spawn
    >>> def body(rank, world):            # must be importable (defined at module level)
    ...     return {"rank": rank, "world": world}
    >>> spawn(body, world_size=2)         # doctest: +SKIP
    {'rank': 0, 'world': 2}
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port", "BenchError"]


class BenchError(RuntimeError):
    """A benchmark worker failed; the message carries rank 0's traceback."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, body: Callable, args: tuple, out_path: str,
            num_threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(num_threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        try:
            result = {"ok": body(rank, world, *args)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, then re-raised
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            if rank == 0:
                torch.save(result, out_path)
            raise
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def spawn(body: Callable, *, world_size: int = 2, args: tuple = (), timeout_s: float = 600,
          num_threads: int = 1) -> Any:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` gloo ranks; return rank 0's value."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.pt")
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), body, args, out_path, num_threads),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{body.__name__} did not finish in {timeout_s:.0f}s")
        except (TimeoutError, mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            detail = ""
            if os.path.exists(out_path):
                detail = torch.load(out_path, weights_only=False).get("traceback", "")
            raise BenchError(f"{body.__name__} failed: {exc}\n{detail}") from exc
        result = torch.load(out_path, weights_only=False)
    if "error" in result:
        raise BenchError(f"{body.__name__} failed on rank 0:\n{result['traceback']}")
    return result["ok"]
