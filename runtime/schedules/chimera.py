"""Chimera (Li and Hoefler 2021): two pipelines in opposite directions over two model replicas.

The model is cut into ``p`` parts and held twice. Stages ``0 .. p-1`` are the *down*
replica, stage ``s`` (part ``s``) on rank ``s``; stages ``p .. 2p-1`` are the *up* replica, stage
``p + k`` (part ``k``) on rank ``p - 1 - k``. So rank ``r`` holds part ``r`` of the down pipeline
and part ``p - 1 - r`` of the up one. Microbatch ``i`` goes down when ``i`` is even and up when odd.
The up pipeline fills the ranks the down pipeline leaves idle at its start and end, so the bubble
is about half of 1F1B's: with equal forward and backward costs and ``m = p`` it is
``(p - 2) / (2m + p - 2)`` of the step (the paper's figure), against ``(p - 1) / (m + p - 1)``.
The price: every rank holds two parts' weights, and the two replicas' gradients of each part are
summed after the backward (the runtime exchanges them between ranks ``r`` and ``p - 1 - r``).
The paper takes ``p`` and ``m`` even; here an odd ``p`` puts both replicas of the middle part on
the middle rank (one copy of its weights), and an odd ``m`` sends one more microbatch down.

The per-rank order comes from greedy list scheduling (backward first, oldest microbatch first)
with the paper's costs (backward = 2 x forward) and 1F1B's activation cap per stage.

    >>> print(chimera(num_ranks=2, num_microbatches=2).to_csv(), end="")
    0F0,3F1,3B1,0B0
    2F1,1F0,1B0,2B1
"""
from __future__ import annotations

from autopar.runtime.schedules._common import check_count
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.list_scheduler import list_schedule

__all__ = ["chimera", "chimera_placement"]


def chimera_placement(num_ranks: int) -> tuple[int, ...]:
    """``stage_to_rank`` of Chimera's ``2p`` stages: down replica on ranks 0..p-1, up on p-1..0."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def chimera(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Chimera's bidirectional schedule (the paper's setting is an even number of ranks and microbatches)."""
    p = check_count("chimera", "num_ranks", num_ranks)
    m = check_count("chimera", "num_microbatches", num_microbatches)
    routes = tuple(i % 2 for i in range(m))
    chains = [tuple(range(k * p, (k + 1) * p)) for k in routes]
    rows = list_schedule(num_ranks=p, stage_to_rank=chimera_placement(p), chains=chains,
                         cap=lambda stage: p - stage % p)
    return Schedule(name="chimera", num_ranks=p, num_stages=2 * p, num_microbatches=m,
                    stage_to_rank=chimera_placement(p), actions=tuple(map(tuple, rows)),
                    num_replicas=2, microbatch_replica=routes)
