"""Precision said out loud: a GPU plan kept in fp32 says so, with what bf16 would change.

On a GPU whose bf16 matrix rate is many times its fp32 rate (A100: 312 against 19.5 TFLOP/s), a plan
that trains in fp32 (autopar's default, ``precision="fp32"``) forgoes most of the device. When the
planner plans fp32 for such a cluster, :func:`precision_note` adds a line to its reasons: the chosen
plan's step time and fullest rank's memory in fp32 and in bf16, the largest global batch the plan's mesh
and microbatches fit in each, and the best bf16 plan the search finds.

The bf16 figures come from the fp32 profile without capturing the model again
(:func:`in_bf16`): FLOPs and op counts as they are, every byte of a floating activation, a collective
or a pipeline transfer halved, and the parameters held in 2 bytes (with the fp32 masters and gradients
the memory calculator adds for ``bf16``). Integer tensors (token ids) and the loss's fp32 upcast are
halved too, so the figures are approximate; ``tests/api/test_planner_precision.py`` holds them to a bf16
profile of the same model.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

from autopar.errors import AutoparError
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import Candidate, CostModel
from autopar.planner.profile import ModelProfile
from autopar.planner.candidates import SearchSpace
from autopar.planner.search import SearchResult, fmt_bytes, search

__all__ = ["in_bf16", "largest_batch", "precision_note", "wants_bf16"]

_HALF = 0.5  # bf16 bytes per fp32 byte


def wants_bf16(cluster: Cluster) -> bool:
    """Whether the cluster's devices compute bf16 matrix products much faster than fp32 (GPUs, not CPUs)."""
    d = cluster.device
    return d.matmul_rate("bf16") > 2 * d.matmul_rate("fp32")


def in_bf16(profile: ModelProfile) -> ModelProfile:
    """The fp32 ``profile`` as bf16 would profile it (floating bytes halved, parameters in 2 bytes)."""
    def chunk(ch):
        return replace(ch, bytes_written=ch.bytes_written * _HALF, recv_bytes=ch.recv_bytes * _HALF,
                       saved={k: v * _HALF for k, v in ch.saved.items()},
                       transient={k: v * _HALF for k, v in ch.transient.items()},
                       comms=tuple(replace(c, nbytes=c.nbytes * _HALF) for c in ch.comms),
                       params=tuple(replace(p, itemsize=min(p.itemsize, 2)) for p in ch.params),
                       moe=tuple(replace(m, dispatch_bytes=m.dispatch_bytes * _HALF,
                                         combine_bytes=m.combine_bytes * _HALF) for m in ch.moe))
    return dataclasses.replace(profile, precision="bf16",
                               chunks={tp: [chunk(ch) for ch in chunks] for tp, chunks in profile.chunks.items()})


def largest_batch(model: CostModel, c: Candidate, *, limit: int = 1 << 16) -> int:
    """The largest global batch (dp x microbatches x samples) candidate ``c``'s mesh, microbatches and stage
    cuts fit on ``model``'s cluster (0 when not even one sample per microbatch fits)."""
    unit = c.dp * c.num_microbatches

    def fits(b: int) -> bool:
        sized = CostModel(replace(model.profile, global_batch=unit * b), model.cluster, optimizer=model.optimizer)
        return sized.estimate(c).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return unit * lo


def precision_note(result: SearchResult, *, space: SearchSpace, optimizer: str = "adam") -> list[str]:
    """A line for the reasons when ``result`` plans fp32 on a cluster that computes bf16 much faster; else []."""
    profile, cluster = result.cost_model.profile, result.cluster
    if profile.precision != "fp32" or not wants_bf16(cluster):
        return []
    best = result.best
    low = CostModel(in_bf16(profile), cluster, optimizer=optimizer)
    same = low.estimate(best.candidate, simulate_pipeline=True)
    batch32, batch16 = largest_batch(result.cost_model, best.candidate), largest_batch(low, best.candidate)
    alt = _best_bf16(low.profile, cluster, result.world, space, optimizer)
    d = cluster.device
    line = (f"precision: fp32, on {d.name} devices that compute bf16 {d.flops['bf16'] / d.flops['fp32']:.0f}x faster "
            f"({d.flops['bf16'] / 1e12:g} against {d.flops['fp32'] / 1e12:g} TFLOP/s peak): in bf16 (precision='bf16', "
            f"autopar plan --precision bf16) this plan would take about {same.step_time:.4g} s/step instead of "
            f"{best.step_time:.4g} ({_pct(same.step_time, best.step_time)}) and hold about {fmt_bytes(same.memory)} "
            f"instead of {fmt_bytes(best.memory)} on its fullest rank; its mesh and microbatches fit a global batch of "
            f"up to {batch16} in bf16, {batch32} in fp32 (planned: {profile.global_batch})")
    if alt is not None:
        line += f"; the best bf16 plan, {alt.candidate.label()}, about {alt.step_time:.4g} s/step"
    return [line]


def _best_bf16(profile: ModelProfile, cluster: Cluster, world: int, space: SearchSpace, optimizer: str):
    try:
        return search(profile, cluster, world=world, space=replace(space, exact_top=1), optimizer=optimizer).best
    except AutoparError:  # nothing fits in bf16 either: the note says what it can
        return None


def _pct(t: float, base: float) -> str:
    return f"{(t / base - 1) * 100:+.0f}%" if math.isfinite(t) and base else "n/a"
