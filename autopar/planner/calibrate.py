"""Calibration: a short profiling run that measures this machine, so predictions can be checked.

What the cost model needs, measured rather than looked up:

- :func:`measure_compute`: matmul FLOP/s (fp32, one process, at transformer-like shapes), memory
  bandwidth (a large elementwise op) and the overhead of one graph op in forward and backward
  (a chain of tiny ops under autograd); each the median of a few repeats;
- :func:`measure_collectives` (every rank of a process group calls it): all-reduce latency and
  bandwidth fitted to the ring model ``2(n-1)·alpha + 2(n-1)/n·bytes/beta`` over a few sizes, and
  point-to-point ``alpha + bytes/beta`` from a ping-pong between ranks 0 and 1.

Run inside a job, every rank measures while the others do the same, so the figures include the
ranks' contention for shared cores. :func:`calibrated_cluster` turns the figures into a
:class:`~autopar.planner.cluster.Cluster`; :func:`calibrate` spawns ``world_size`` gloo processes
on this machine and returns it (a few seconds)::

    >>> cluster = calibrate(world_size=2)        # doctest: +SKIP
    >>> report = autopar.plan(model, 2, plan="auto", cluster=cluster, ...).planner
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from autopar.planner.cluster import Cluster, Link, get_cluster

__all__ = ["Calibration", "measure_compute", "measure_collectives", "measure_model", "fit_device",
           "calibrated_cluster", "calibrate", "combine"]


@dataclass(frozen=True)
class Calibration:
    """This machine's figures as one rank saw them."""

    matmul_flops: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    op_overhead_s: float  # per graph op, forward (backward costs about the same again)
    allreduce_latency_s: float
    allreduce_bandwidth: float  # bytes/s
    p2p_latency_s: float
    p2p_bandwidth: float
    world_size: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_compute(*, repeats: int = 5, shape: tuple[int, int, int] = (512, 256, 768)) -> dict:
    """Matmul FLOP/s, memory bandwidth and per-op overhead of this process (fp32)."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    reps = 8
    t = _median_time(lambda: [a @ b for _ in range(reps)], repeats)
    flops = 2 * m * k * n * reps / t
    x, y = torch.randn(4 * 2**20), torch.randn(4 * 2**20)
    t = _median_time(lambda: torch.add(x, y), repeats)
    bandwidth = 3 * x.numel() * 4 / t  # two reads, one write
    leaf = torch.randn(8, requires_grad=True)
    chain = 200

    def ops():
        z = leaf
        for _ in range(chain):
            z = torch.ops.aten.mul.Tensor(z, 1.0001)
        z.sum().backward()

    t = _median_time(ops, repeats)
    return {"matmul_flops": flops, "memory_bandwidth": bandwidth, "op_overhead_s": t / (2 * chain)}


def measure_model(model, *, example_inputs: tuple, loss_fn, example_target, sizes=(1, 8), repeats: int = 3,
                  optimizer=None) -> dict:
    """Seconds of one forward and backward of ``model`` at each batch size in ``sizes`` (and of one
    optimizer step when ``optimizer`` is given): the model's own profile of this machine."""
    out = {}
    for b in sizes:
        inputs = tuple(t[:b] for t in example_inputs)
        target = example_target[:b]

        def step():
            model.zero_grad(set_to_none=True)
            loss_fn(model(*inputs), target).backward()
        out[b] = _median_time(step, repeats)
    if optimizer is not None:
        out["optimizer"] = _median_time(optimizer.step, repeats)
    return out


def fit_device(profile, timings: dict, *, memory_bandwidth: float, op_overhead_s: float | None = None) -> dict:
    """Per-op overhead and matmul rate that make the cost model reproduce ``timings``.

    The cost model charges a forward and backward ``3·(ops·o + b·(flops/R + bytes/BW))`` over the
    model's chunks (tp=1). With ``op_overhead_s`` measured apart (the tiny-op chain of
    :func:`measure_compute`), one batch size gives ``R``; with two, the part that does not grow with
    the batch gives ``o`` too (noisier on a loaded machine).
    """
    chunks = profile.chunks[1]
    ops = sum(c.ops for c in chunks)
    flops = sum(c.flops for c in chunks)
    written = sum(c.bytes_written for c in chunks)
    sizes = sorted((b, t) for b, t in timings.items() if isinstance(b, int))
    if op_overhead_s is None:
        (b1, t1), (b2, t2) = sizes[:2]
        per_sample = max((t2 - t1) / (b2 - b1), 1e-12)
        op_overhead_s = max(t1 - b1 * per_sample, 0.0) / (3 * ops)
    else:
        b, t = sizes[-1]
        per_sample = max(t - 3 * ops * op_overhead_s, 0.1 * t) / b
    compute = per_sample / 3 - written / memory_bandwidth
    rate = flops / compute if compute > 0 else flops / (per_sample / 3)
    return {"op_overhead_s": op_overhead_s, "matmul_flops": rate}


def _fit(sizes, times, factor) -> tuple[float, float]:
    """``t = a + size/b`` through the smallest and the largest size: (a, b).

    Two points, not least squares: the largest transfer sets the bandwidth, the smallest the
    latency; a regression over all sizes lets the big ones' noise swamp the latency.
    """
    (s0, t0), (s1, t1) = min(zip(sizes, times)), max(zip(sizes, times))
    slope = max((t1 - t0) / (s1 - s0), 1e-15)
    return max(t0 - slope * s0, 1e-7), factor / slope


def measure_collectives(*, group=None, repeats: int = 3, sizes=(2**12, 2**18, 2**22, 2**25)) -> dict:
    """All-reduce and p2p alpha/beta over ``group`` (collective: every rank calls it).

    The sizes reach a small model's whole gradient (32 MB): on shared cores a large gloo all-reduce
    costs far more than small ones extrapolate to, and that is the size data parallelism sends.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    times = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        times.append(_median_time(lambda: dist.all_reduce(buf, group=group), repeats))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    steps = 2 * (n - 1)
    alpha, beta = _fit([s * steps / n for s in sizes], t.tolist(), 1.0)
    out = {"allreduce_latency_s": alpha / steps, "allreduce_bandwidth": beta}
    pp = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)

        def ping():
            if rank == 0:
                dist.send(buf, 1, group=group)
                dist.recv(buf, 1, group=group)
            elif rank == 1:
                dist.recv(buf, 0, group=group)
                dist.send(buf, 0, group=group)
        pp.append(_median_time(ping, repeats) / 2)
    t = torch.tensor(pp, dtype=torch.float64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    alpha, beta = _fit(list(sizes), t.tolist(), 1.0)
    out.update(p2p_latency_s=alpha, p2p_bandwidth=beta)
    return out


def calibrated_cluster(cal: Calibration, *, base: Cluster | str = "cpu-2core") -> Cluster:
    """``base`` with this machine's measured device and links (contention already in the figures)."""
    base = get_cluster(base)
    device = base.device.model_copy(update={"name": f"{base.device.name} (calibrated)",
                                            "flops": {"fp32": cal.matmul_flops, "bf16": cal.matmul_flops / 3},
                                            "efficiency": 1.0, "memory_bandwidth": cal.memory_bandwidth,
                                            "op_overhead_s": cal.op_overhead_s})
    link = Link(latency_s=cal.allreduce_latency_s, bandwidth=cal.allreduce_bandwidth)
    p2p = Link(latency_s=cal.p2p_latency_s, bandwidth=cal.p2p_bandwidth)
    return base.model_copy(update={"name": f"{base.name}-calibrated", "device": device, "intra": link,
                                   "inter": link, "p2p": p2p, "cores_per_node": None}).for_world(cal.world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        figures = measure_compute()
        figures.update(measure_collectives())
        gathered = [None] * world
        dist.all_gather_object(gathered, figures)
        if rank == 0:
            torch.save(gathered, path)
    finally:
        dist.destroy_process_group()


def calibrate(world_size: int = 2, *, base: Cluster | str = "cpu-2core", timeout_s: float = 300) -> Cluster:
    """Spawn ``world_size`` gloo processes on this machine, measure, and return the calibrated cluster."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calibration.pt")
        ctx = mp.start_processes(_worker, args=(world_size, _free_port(), path), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"calibration did not finish in {timeout_s:.0f} s")
        gathered = torch.load(path, weights_only=False)
    return calibrated_cluster(combine(gathered, world_size), base=base)


def combine(per_rank: list[dict], world_size: int) -> Calibration:
    """One Calibration from every rank's figures (medians; the slowest collective)."""
    def med(key):
        return statistics.median(f[key] for f in per_rank)
    return Calibration(matmul_flops=med("matmul_flops"), memory_bandwidth=med("memory_bandwidth"),
                       op_overhead_s=med("op_overhead_s"), allreduce_latency_s=med("allreduce_latency_s"),
                       allreduce_bandwidth=med("allreduce_bandwidth"), p2p_latency_s=med("p2p_latency_s"),
                       p2p_bandwidth=med("p2p_bandwidth"), world_size=world_size)
