"""Time of one microbatch on one chunk: compute, memory traffic, per-op overhead and the chunk's collectives.

The per-chunk formulas the cost model (:mod:`autopar.planner.cost_model`) sums into its prefix tables: the
chunk's matmuls at the device's rate for the microbatch, its bytes at memory bandwidth, its ops at the
per-op overhead, its tp collectives by the alpha-beta model, mixture-of-experts all-to-alls
(:func:`moe_comm`) and, under context parallelism, a rank's 1/cp of each sequence and the attention's traffic:
the ring's K/V hops (:func:`cp_ring`) or the all-to-all's four exchanges (:func:`cp_all_to_all`).
"""
from __future__ import annotations

from autopar.planner.cluster import Cluster, Device
from autopar.planner.profile import ChunkCost

__all__ = ["chunk_times", "moe_comm", "cp_ring", "cp_all_to_all", "cp_comm", "comm_time"]


def comm_time(comms, *, tp: int, b: int, link, direction: str, include_recompute: bool) -> float:
    return sum(link.collective(c.op, c.nbytes * b, tp) for c in comms
               if c.direction == direction and (include_recompute or not c.recompute))


def moe_comm(chunk: ChunkCost, *, b: int, ep: int, link) -> tuple[float, float]:
    """(forward, backward) seconds of the all-to-alls of ``chunk``'s MoE layers for a microbatch of ``b``.

    Per layer, forward: the per-expert row counts (E int64), the dispatch of the routed rows and the
    combine of the expert outputs, each an all-to-all among the ``ep`` ranks; backward: the two
    conjugates (the gradient rows the way the rows came). Dropless, every ep rank routing alike.
    """
    if ep <= 1:
        return 0.0, 0.0
    forward = backward = 0.0
    for layer in chunk.moe:
        rows = link.all_to_all(layer.dispatch_bytes * b, ep) + link.all_to_all(layer.combine_bytes * b, ep)
        forward += link.all_to_all(8 * layer.num_experts, ep) + rows
        backward += rows
    return forward, backward


def cp_ring(chunk: ChunkCost, *, b: int, cp: int, link) -> tuple[float, float]:
    """(forward, backward) seconds of the ring of ``chunk``'s attentions under context parallelism: each rank's
    K/V shard passed ``cp - 1`` hops forward; backward the K/V again and the dK/dV back (counted whole, not hidden
    behind the blocks' compute)."""
    if cp <= 1 or not chunk.attention_kv:
        return 0.0, 0.0
    hop = link.p2p(chunk.attention_kv * b / cp)
    return (cp - 1) * hop, (2 * cp - 1) * hop


def cp_all_to_all(chunk: ChunkCost, *, b: int, cp: int, link) -> tuple[float, float]:
    """(forward, backward) seconds of the all-to-all (Ulysses) attention of ``chunk`` under context parallelism:
    forward, a rank's 1/cp of Q, K and V from sequence shards to head shards and the output back (four
    all-to-alls among the ``cp`` ranks); backward, their four conjugates (dO, dQ, dK, dV)."""
    if cp <= 1 or not (chunk.attention_kv or chunk.attention_qo):
        return 0.0, 0.0
    q_and_out, kv = chunk.attention_qo * b / cp, chunk.attention_kv * b / cp
    one_way = 2 * link.all_to_all(q_and_out / 2, cp) + 2 * link.all_to_all(kv / 2, cp)
    return one_way, one_way


def cp_comm(chunk: ChunkCost, *, b: int, cp: int, strategy: str, link) -> tuple[float, float]:
    """(forward, backward) seconds of ``chunk``'s attention traffic under ``cp`` with ``strategy`` (``ring`` or
    ``all_to_all``, as the Plan's ``cp_strategy`` pins it)."""
    return (cp_all_to_all if strategy == "all_to_all" else cp_ring)(chunk, b=b, cp=cp, link=link)


def chunk_times(chunk: ChunkCost, *, b: int, tp: int, device: Device, cluster: Cluster, precision: str,
                recompute: str, contention: float = 1.0, ep: int = 1, ep_link=None, cp: int = 1,
                cp_link=None, cp_strategy: str = "ring") -> tuple[float, float, float]:
    """(forward, input-gradient backward, weight-gradient) seconds of one microbatch on ``chunk``
    (with ``ep`` > 1 its MoE layers' all-to-alls over ``ep_link``, :func:`moe_comm`; with ``cp`` > 1 a rank's
    ``1/cp`` of every sequence, the attention's traffic over ``cp_link`` by ``cp_strategy``, :func:`cp_comm`)."""
    rate = device.matmul_rate(precision, samples=b) / contention
    matmul = chunk.flops * b / cp / rate + chunk.gemms * device.gemm_overhead_s * contention
    memory = chunk.bytes_written * b / cp / device.memory_bandwidth * contention
    ops = chunk.ops * device.op_overhead_s * contention
    fwd_comm = comm_time(chunk.comms, tp=tp, b=b / cp, link=cluster.intra, direction="forward",
                          include_recompute=False)
    bwd_comm = comm_time(chunk.comms, tp=tp, b=b / cp, link=cluster.intra, direction="backward",
                          include_recompute=True)
    fwd_a2a, bwd_a2a = moe_comm(chunk, b=b, ep=ep, link=ep_link or cluster.intra)
    fwd_ring, bwd_ring = cp_comm(chunk, b=b, cp=cp, strategy=cp_strategy, link=cp_link or cluster.intra)
    forward = matmul + memory + ops + fwd_comm + fwd_a2a + fwd_ring
    backward = matmul + memory + ops + bwd_comm + bwd_a2a + bwd_ring
    weight = matmul + memory + ops
    if recompute == "full":
        backward += forward
    elif recompute == "selective":
        backward += memory + ops
    return forward, backward, weight
