"""The cluster the planner plans for: devices, nodes and links, as a validated pydantic model.

A :class:`Cluster` is ``nodes`` nodes of ``devices_per_node`` devices each. A :class:`Device`
says how fast it computes (peak FLOP/s per precision, the share of peak that training matmuls
reach, memory bandwidth, per-op overhead) and how much memory it has; a :class:`Link` is an
alpha-beta model of a connection (latency in seconds, bandwidth in bytes per second). Devices of
a node share the ``intra`` link (NVLink, shared memory); nodes talk over ``inter`` (InfiniBand).

Presets: :func:`get_cluster` ``("a100-80g-8x")``, ``"h100-80g-8x"``, ``"a100-40g-8x"`` (one node of 8
GPUs each; ``nodes=128`` makes 1,024 of them) and ``"cpu-2core"`` (this kind of machine: up to 8
gloo processes sharing 2 cores). Describe your own with ``Cluster(...)`` or edit a preset with
``cluster.model_copy(update=...)``; a heterogeneous cluster lists its node kinds in ``groups``.

    >>> c = get_cluster("a100-80g-8x", nodes=128)
    >>> c.world_size, c.device_of(1023).memory_gb
    (1024, 80.0)
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from autopar.errors import PlanError
from autopar.plan_model import UserModel

__all__ = ["Link", "Device", "NodeGroup", "Cluster", "CLUSTER_PRESETS", "get_cluster", "cluster_names", "local_cluster",
           "A100_80G", "A100_40G", "H100_80G", "CPU_CORE"]

GB = 1e9


class _Frozen(UserModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Link(_Frozen):
    """A connection as latency (alpha, seconds) plus size / bandwidth (beta, bytes per second)."""

    latency_s: float = Field(gt=0)
    bandwidth: float = Field(gt=0)

    def p2p(self, nbytes: float) -> float:
        """One point-to-point transfer."""
        return self.latency_s + nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, n: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``n`` ranks."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (n - 1) * self.latency_s + 2 * (n - 1) / n * nbytes / self.bandwidth

    def all_gather(self, nbytes: float, n: int) -> float:
        """Ring all-gather (or reduce-scatter) whose full result is ``nbytes``."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return (n - 1) * self.latency_s + (n - 1) / n * nbytes / self.bandwidth

    def all_to_all(self, nbytes: float, n: int) -> float:
        """All-to-all among ``n`` ranks, each holding ``nbytes`` of which it keeps ``1/n`` and sends the
        rest, one message to each peer: ``(n-1)·alpha + (n-1)/n·nbytes/beta``."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return (n - 1) * self.latency_s + (n - 1) / n * nbytes / self.bandwidth

    def collective(self, kind: str, nbytes: float, n: int) -> float:
        """``kind``: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast or reduce."""
        if kind == "all_to_all":
            return self.all_to_all(nbytes, n)
        if kind == "all_reduce":
            return self.all_reduce(nbytes, n)
        if kind in ("all_gather", "reduce_scatter"):
            return self.all_gather(nbytes, n)
        if n <= 1 or nbytes <= 0:
            return 0.0
        return (n - 1).bit_length() * self.latency_s + nbytes / self.bandwidth  # pipelined tree


class Device(_Frozen):
    """One accelerator (or CPU process): speed and memory."""

    name: str
    flops: dict[Literal["fp32", "bf16"], float]  # peak FLOP/s by compute precision
    efficiency: float = Field(0.5, gt=0, le=1)  # share of peak reached by training matmuls
    memory_gb: float = Field(gt=0)
    memory_bandwidth: float = Field(gt=0)  # bytes/s, for memory-bound ops and the optimizer step
    op_overhead_s: float = Field(5e-6, ge=0)  # per graph op in forward (kernel launch, Python dispatch)
    # (samples per microbatch, factor on the matmul rate): how the rate changes with the microbatch,
    # measured for the model being planned (calibrate.fit_batch_efficiency); empty: the same at every size
    batch_efficiency: tuple[tuple[int, float], ...] = ()
    # what a backward split into B and W (zero-bubble schedules) costs beyond a whole one, as a share
    # of it: the split walks the graph twice and re-reads each use's gradient in W
    split_backward_overhead: float = Field(0.0, ge=0)
    # seconds each matrix product costs beyond its FLOPs at ``efficiency`` (launch, tail of the last wave):
    # small products reach less of the rate than large ones; fitted to published runs (published_fit.py)
    gemm_overhead_s: float = Field(0.0, ge=0)

    def matmul_rate(self, precision: str, samples: int | None = None) -> float:
        """FLOP/s training reaches at ``precision`` (with ``samples`` per microbatch, if measured)."""
        peak = self.flops.get(precision) or self.flops.get("fp32") or next(iter(self.flops.values()))
        return peak * self.efficiency * (self.rate_factor(samples) if samples is not None else 1.0)

    def rate_factor(self, samples: int) -> float:
        """``batch_efficiency`` at ``samples``: linear in log2(samples) between measured sizes, the
        nearest measured size's factor outside them, 1 without a table.

        >>> d = CPU_CORE.model_copy(update={"batch_efficiency": ((2, 0.8), (8, 1.0))})
        >>> d.rate_factor(4), d.rate_factor(1), d.rate_factor(64)
        (0.9, 0.8, 1.0)
        """
        table = sorted(self.batch_efficiency)
        if not table:
            return 1.0
        if samples <= table[0][0]:
            return table[0][1]
        for (b0, f0), (b1, f1) in zip(table, table[1:]):
            if samples <= b1:
                w = (math.log2(samples) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return f0 + w * (f1 - f0)
        return table[-1][1]


class NodeGroup(_Frozen):
    """``count`` nodes whose devices are all ``device``."""

    count: int = Field(ge=1)
    device: Device


class Cluster(_Frozen):
    """``nodes`` nodes of ``devices_per_node`` devices; ``groups`` makes it heterogeneous."""

    name: str = "cluster"
    nodes: int = Field(1, ge=1)
    devices_per_node: int = Field(ge=1)
    device: Device
    groups: tuple[NodeGroup, ...] = ()  # heterogeneous: node kinds in rank order (counts sum to nodes)
    intra: Link  # between devices of one node
    inter: Link  # between nodes (per device)
    p2p: Link | None = None  # pipeline sends, when measured apart from the collectives (calibration)
    cores_per_node: int | None = Field(None, ge=1)  # CPU processes: more ranks than cores share them
    # CPU seconds each pipeline action costs beyond its compute where ranks outnumber cores (a rank
    # resuming after a wait finds its caches refilled by others; calibrate.measure_switch)
    shared_core_switch_s: float = Field(0.0, ge=0)
    memory_reserve: float = Field(0.1, ge=0, lt=1)  # share of device memory kept free (allocator, workspace)
    dp_overlap: float = Field(0.0, ge=0, le=1)  # share of the dp gradient reduction hidden behind backward
    # seconds every step costs beyond its pipeline, communication and optimizer (data loading, launch,
    # logging, the loss's reduction): fitted to published runs on the GPU presets (published_fit.py)
    step_overhead_s: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _groups_cover_nodes(self) -> "Cluster":
        if self.groups and sum(g.count for g in self.groups) != self.nodes:
            raise PlanError(f"Cluster.groups count {sum(g.count for g in self.groups)} nodes, not nodes={self.nodes}",
                            where="Cluster.groups", fix="make the group counts add up to nodes")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def heterogeneous(self) -> bool:
        return len({g.device for g in self.groups}) > 1

    def device_of(self, rank: int) -> Device:
        """The device global rank ``rank`` runs on (ranks fill nodes in order)."""
        node = rank // self.devices_per_node
        for group in self.groups:
            if node < group.count:
                return group.device
            node -= group.count
        return self.device

    def contention(self, ranks_per_node: int) -> float:
        """How many ranks share one core (CPU processes), at least 1."""
        if self.cores_per_node is None:
            return 1.0
        return max(1.0, min(ranks_per_node, self.devices_per_node) / self.cores_per_node)

    def usable_bytes(self, rank: int) -> float:
        """Memory the planner may fill on ``rank``."""
        return self.device_of(rank).memory_gb * GB * (1 - self.memory_reserve)

    def for_world(self, world: int) -> "Cluster":
        """This cluster resized to ``world`` ranks (whole nodes; a partial node when ``world`` is smaller)."""
        if world <= self.devices_per_node:
            return self.model_copy(update={"nodes": 1, "devices_per_node": world,
                                           "groups": self.groups[:1] and (self.groups[0].model_copy(
                                               update={"count": 1}),)})
        if world % self.devices_per_node:
            raise PlanError(f"{world} ranks do not fill whole nodes of {self.devices_per_node} devices",
                            where=f"cluster {self.name}",
                            fix=f"plan for a multiple of {self.devices_per_node} ranks, or describe the cluster")
        nodes = world // self.devices_per_node
        if self.groups and nodes != self.nodes:
            raise PlanError(f"a heterogeneous cluster has {self.nodes} nodes, not {nodes}",
                            where=f"cluster {self.name}", fix=f"plan for {self.world_size} ranks")
        return self.model_copy(update={"nodes": nodes})


# The A100 figures marked (fit) are fitted to 13 published runs of Megatron-LM and Megatron-DeepSpeed on up to
# 3,360 A100s (autopar/planner/published_fit.py, docs/planner.md "The GPU presets held to published runs"); they
# are effective figures that make this cost model reproduce those runs, not measurements: no GPU was used.
_A100_MEMORY_SHARE = 3.47e12 / 2.0e12  # (fit) memory-bound ops see 1.7x HBM: the runs fuse what the model counts
A100_80G = Device(name="A100-SXM4-80GB", flops={"bf16": 312e12, "fp32": 19.5e12}, efficiency=0.642,  # (fit)
                  memory_gb=80, memory_bandwidth=2.0e12 * _A100_MEMORY_SHARE, op_overhead_s=5e-6,
                  gemm_overhead_s=7.8e-6)  # (fit)
A100_40G = A100_80G.model_copy(update={"name": "A100-SXM4-40GB", "memory_gb": 40,
                                       "memory_bandwidth": 1.55e12 * _A100_MEMORY_SHARE})
H100_80G = Device(name="H100-SXM5-80GB", flops={"bf16": 989e12, "fp32": 67e12}, efficiency=0.45,
                  memory_gb=80, memory_bandwidth=3.35e12, op_overhead_s=4e-6)
#: One core of this kind of 2-core machine as one gloo process sees it (calibrate for real figures).
CPU_CORE = Device(name="cpu-core", flops={"fp32": 25e9, "bf16": 8e9}, efficiency=1.0, memory_gb=2.5,
                  memory_bandwidth=8e9, op_overhead_s=2.5e-5,
                  # measured on this machine (GPT 8x256, 2 ranks): a split stage's B + W took 12-19%
                  # longer than 1F1B's whole backward of the same blocks
                  split_backward_overhead=0.15)

_NVLINK3 = Link(latency_s=8e-6, bandwidth=230e9)  # A100 NVLink, all-reduce bus bandwidth (NCCL, measured by others)
_NVLINK4 = Link(latency_s=6e-6, bandwidth=360e9)
_HDR = Link(latency_s=15e-6, bandwidth=22e9)  # one 200 Gb/s HDR port per GPU
_NDR = Link(latency_s=12e-6, bandwidth=45e9)  # one 400 Gb/s NDR port per GPU
# (fit) what the published A100 runs paid: tp all-reduces as if at 565 GB/s (above the hardware's ~230: the model
# charges them more than the runs did), traffic between nodes as if at 7.2 GB/s per GPU (below HDR's ~22-25)
_NVLINK3_FIT = _NVLINK3.model_copy(update={"bandwidth": 565e9})
_HDR_FIT = _HDR.model_copy(update={"bandwidth": 7.2e9})
_A100_STEP_OVERHEAD_S = 0.053  # (fit) seconds per step beyond the pipeline, communication and optimizer
_LOOPBACK = Link(latency_s=1.5e-4, bandwidth=1.0e9)  # gloo over 127.0.0.1

CLUSTER_PRESETS: dict[str, Cluster] = {
    "a100-80g-8x": Cluster(name="a100-80g-8x", devices_per_node=8, device=A100_80G, intra=_NVLINK3_FIT,
                           inter=_HDR_FIT, dp_overlap=0.7, step_overhead_s=_A100_STEP_OVERHEAD_S),
    "a100-40g-8x": Cluster(name="a100-40g-8x", devices_per_node=8, device=A100_40G, intra=_NVLINK3_FIT,
                           inter=_HDR_FIT, dp_overlap=0.7, step_overhead_s=_A100_STEP_OVERHEAD_S),
    "h100-80g-8x": Cluster(name="h100-80g-8x", devices_per_node=8, device=H100_80G, intra=_NVLINK4, inter=_NDR,
                           dp_overlap=0.7),
    "cpu-2core": Cluster(name="cpu-2core", devices_per_node=8, device=CPU_CORE, intra=_LOOPBACK,
                         inter=_LOOPBACK, cores_per_node=2, memory_reserve=0.0,
                         shared_core_switch_s=1.5e-3),  # calibrate.measure_switch, 4 ranks on 2 cores: 1.7 ms
}


def cluster_names() -> tuple[str, ...]:
    return tuple(CLUSTER_PRESETS)


def get_cluster(name: str | Cluster, *, nodes: int | None = None, world: int | None = None) -> Cluster:
    """A preset by name (or a Cluster as is), resized to ``nodes`` nodes or ``world`` ranks."""
    if isinstance(name, Cluster):
        cluster = name
    elif name in CLUSTER_PRESETS:
        cluster = CLUSTER_PRESETS[name]
    else:
        raise PlanError(f"unknown cluster preset {name!r}", where="cluster=",
                        fix=f"use one of {', '.join(CLUSTER_PRESETS)} or pass an autopar.planner.Cluster")
    if nodes is not None:
        cluster = cluster.for_world(nodes * cluster.devices_per_node)
    if world is not None:
        cluster = cluster.for_world(world)
    return cluster


def _ram_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 16.0


def local_cluster() -> Cluster:
    """This machine with uncalibrated figures: its GPUs, or its CPU cores shared by gloo processes.

    :func:`autopar.planner.calibrate.calibrate` measures the real figures.
    """
    import os

    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        preset = CLUSTER_PRESETS["h100-80g-8x" if "H100" in props.name else "a100-80g-8x"]
        device = preset.device.model_copy(update={"name": props.name, "memory_gb": props.total_memory / GB})
        return preset.model_copy(update={"name": "local-gpu", "devices_per_node": torch.cuda.device_count(),
                                         "device": device})
    cores = os.cpu_count() or 1
    slots = max(8, cores)
    device = CPU_CORE.model_copy(update={"memory_gb": round(_ram_gb() * 0.85 / slots, 2)})
    return Cluster(name=f"local-cpu-{cores}core", devices_per_node=slots, device=device, intra=_LOOPBACK,
                   inter=_LOOPBACK, cores_per_node=cores, memory_reserve=0.0)
