"""Calibration: a short profiling run that measures this machine, so predictions can be checked.

What the cost model needs, measured rather than looked up:

- :func:`measure_compute`: matmul FLOP/s (fp32, one process, at transformer-like shapes), memory
  bandwidth (a large elementwise op) and the overhead of one graph op in forward and backward
  (a chain of tiny ops under autograd); each the median of a few repeats;
- :func:`measure_model` and :func:`fit_device` / :func:`fit_batch_efficiency`: the model's own
  forward and backward at a few batch sizes, to which the matmul rate and its change with the
  microbatch size are fitted;
- :func:`measure_switch` (every rank at once): the CPU time an action costs beyond its compute when
  ranks block on each other between actions (on shared cores, a resumed rank's caches are cold);
- :func:`measure_collectives` (every rank of a process group calls it): all-reduce latency and
  bandwidth fitted to the ring model ``2(n-1)·alpha + 2(n-1)/n·bytes/beta`` over a few sizes, and
  point-to-point ``alpha + bytes/beta`` from a ping-pong between ranks 0 and 1.

Run inside a job, every rank measures while the others do the same, so the figures include the
ranks' contention for shared cores. :func:`calibrated_cluster` turns the figures into a
:class:`~autopar.planner.cluster.Cluster`; :func:`calibrate` spawns ``world_size`` gloo processes
on this machine and returns it (a few seconds; it spawns processes, so this is a sketch, not a doctest)::

    cluster = calibrate(world_size=2)
    report = autopar.plan(model, 2, plan="auto", cluster=cluster, ...).planner
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
           "fit_batch_efficiency",
           "measure_switch", "calibrated_cluster", "calibrate", "combine"]


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
    batch_efficiency: tuple[tuple[int, float], ...] = ()  # (samples, rate factor), from the model's own profile
    cores: int | None = None  # CPU cores the ranks shared while measuring (None: a device each)
    switch_s: float = 0.0  # CPU seconds per action when ranks block on each other (measure_switch)

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
    return {"matmul_flops": flops, "memory_bandwidth": bandwidth, "op_overhead_s": t / (2 * chain),
            "cores": None if torch.cuda.is_available() else os.cpu_count()}


def _mean_time(fn, repeats: int, min_seconds: float) -> float:
    """Mean seconds of ``fn`` over at least ``repeats`` back-to-back calls lasting ``min_seconds``."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < repeats or time.perf_counter() - t0 < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def measure_model(model, *, example_inputs: tuple, loss_fn, example_target, sizes=(1, 8), repeats: int = 3,
                  optimizer=None, sync=None, min_seconds: float = 0.0) -> dict:
    """Seconds of one forward and backward of ``model`` at each batch size in ``sizes`` (and of one
    optimizer step when ``optimizer`` is given): the model's own profile of this machine.

    Each figure is the median of ``repeats`` calls, or with ``min_seconds`` the mean over calls
    back to back for at least that long. Ranks that measure at once on shared cores need both
    that and ``sync`` (e.g. ``torch.distributed.barrier``, run before each size, so that they time
    the same size together): the operating system gives the cores to two of four ranks for a few
    milliseconds at a time, so a short pass timed alone may run at a lone rank's speed, and small
    sizes then come out faster than they are.
    """
    out = {}
    for b in sizes:
        if sync is not None:
            sync()
        inputs = tuple(t[:b] for t in example_inputs)
        target = example_target[:b]

        def step():
            model.zero_grad(set_to_none=True)
            loss_fn(model(*inputs), target).backward()
        out[b] = _mean_time(step, repeats, min_seconds) if min_seconds else _median_time(step, repeats)
    if optimizer is not None:
        if sync is not None:
            sync()
        out["optimizer"] = (_mean_time(optimizer.step, repeats, min_seconds) if min_seconds
                            else _median_time(optimizer.step, repeats))
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


def fit_batch_efficiency(profile, timings: dict, *, memory_bandwidth: float, op_overhead_s: float,
                         reference: int | None = None) -> tuple[tuple[int, float], ...]:
    """How the matmul rate changes with the microbatch: ``(samples, rate / rate at reference)`` for
    every batch size in ``timings`` (:func:`measure_model` at several sizes), the rate at each size
    fitted as :func:`fit_device` fits it at one. ``reference`` (default: the largest size) is the
    size whose rate the device's ``flops`` hold. On a CPU small microbatches run below the large ones'
    rate (a microbatch of 2 sequences of 64 tokens about 10% below one of 16) and very large ones
    fall out of cache, so a schedule with many microbatches pays more than its FLOPs say.
    """
    sizes = sorted(b for b in timings if isinstance(b, int))
    reference = sizes[-1] if reference is None else reference
    rates = {b: fit_device(profile, {b: timings[b]}, memory_bandwidth=memory_bandwidth,
                           op_overhead_s=op_overhead_s)["matmul_flops"] for b in sizes}
    return tuple((b, rates[b] / rates[reference]) for b in sizes)


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


def measure_switch(*, group=None, action_s: float = 0.01, working_set_bytes: int = 4 * 2**20, actions: int = 30,
                   repeats: int = 3) -> float:
    """CPU seconds one action costs beyond its compute when ranks block on each other between actions
    (collective: every rank calls it at once).

    Every rank runs ``actions`` matmul "actions" on a working set of ``working_set_bytes`` (a stage's
    weights), first back to back, then passing a token round the ring after each one, so that each
    rank blocks and resumes as pipeline ranks do. Where ranks outnumber cores, a rank that resumes
    finds its caches filled by the ranks that ran meanwhile; the extra CPU time per action
    (mean over ranks, at least 0) is what :class:`~autopar.planner.cluster.Cluster`'s
    ``shared_core_switch_s`` charges each pipeline action there.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    side = int((working_set_bytes / 4) ** 0.5)
    weight, x = torch.randn(side, side), torch.randn(256, side)
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        x @ weight
        calls += 1
    reps = max(1, round(action_s / (0.2 / calls)))
    token, inbox = torch.zeros(256), torch.zeros(256)
    peers = (dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world,
             dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world)

    def run(exchange: bool) -> float:
        dist.barrier(group=group)
        c0 = time.process_time()
        for _ in range(actions):
            for _ in range(reps):
                x @ weight
            if exchange and world > 1:
                sent = dist.isend(token, peers[0], group=group)
                dist.irecv(inbox, peers[1], group=group).wait()
                sent.wait()
        return time.process_time() - c0

    plain, passing = [], []
    for _ in range(repeats):
        plain.append(run(False))
        passing.append(run(True))
    extra = torch.tensor([(statistics.median(passing) - statistics.median(plain)) / actions], dtype=torch.float64)
    dist.all_reduce(extra, group=group)
    return max(0.0, float(extra) / world)


def calibrated_cluster(cal: Calibration, *, base: Cluster | str = "cpu-2core") -> Cluster:
    """``base`` with this machine's measured device and links.

    Every rank measured compute while the others did the same. Where more ranks than cores did so
    (CPU processes, ``k = world_size / cores``), each saw a ``k``-th of a core: the device is
    given the figures of a rank alone on its core (rate and bandwidth times ``k``, per-op overhead
    over ``k``) and the cluster its ``cores_per_node``, so that the cost model charges the sharing
    itself where ranks are busy together and not where a rank waits in a pipeline bubble and
    lends its core (:func:`autopar.planner.cost_model.CostModel.estimate`); there each pipeline action
    also costs the measured ``switch_s`` (:func:`measure_switch`).
    """
    base = get_cluster(base)
    shared = cal.cores is not None and cal.world_size > cal.cores
    k = cal.world_size / cal.cores if shared else 1.0
    device = base.device.model_copy(update={"name": f"{base.device.name} (calibrated)",
                                            "flops": {"fp32": cal.matmul_flops * k, "bf16": cal.matmul_flops * k / 3},
                                            "efficiency": 1.0, "memory_bandwidth": cal.memory_bandwidth * k,
                                            "op_overhead_s": cal.op_overhead_s / k,
                                            "batch_efficiency": tuple(cal.batch_efficiency)})
    link = Link(latency_s=cal.allreduce_latency_s, bandwidth=cal.allreduce_bandwidth)
    p2p = Link(latency_s=cal.p2p_latency_s, bandwidth=cal.p2p_bandwidth)
    return base.model_copy(update={"name": f"{base.name}-calibrated", "device": device, "intra": link,
                                   "inter": link, "p2p": p2p, "cores_per_node": cal.cores if shared else None,
                                   "shared_core_switch_s": cal.switch_s if shared else 0.0}
                           ).for_world(cal.world_size)


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
        figures["switch_s"] = measure_switch()
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
    tables = [dict(f["batch_efficiency"]) for f in per_rank if f.get("batch_efficiency")]
    sizes = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
    efficiency = tuple((b, statistics.median(t[b] for t in tables)) for b in sizes)
    cores = [f.get("cores") for f in per_rank]
    return Calibration(batch_efficiency=efficiency, cores=cores[0] if len(set(cores)) == 1 else None,
                       switch_s=statistics.median(f.get("switch_s", 0.0) for f in per_rank),
                       matmul_flops=med("matmul_flops"), memory_bandwidth=med("memory_bandwidth"),
                       op_overhead_s=med("op_overhead_s"), allreduce_latency_s=med("allreduce_latency_s"),
                       allreduce_bandwidth=med("allreduce_bandwidth"), p2p_latency_s=med("p2p_latency_s"),
                       p2p_bandwidth=med("p2p_bandwidth"), world_size=world_size)
