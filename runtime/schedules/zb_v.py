"""ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): two stages per rank in a V.

The model is cut into ``2p`` stages; stage ``s`` runs on rank ``s`` for ``s < p`` and on rank
``2p - 1 - s`` otherwise, so rank 0 runs the first and the last stage and activations turn around
on rank ``p - 1`` without a transfer. Backward is split into B (input gradient) and W (weight
gradient). With equal F, B and W costs its bubble is only the pipeline fill, and with no flush
between steps it is zero; rank 0 holds at most ``2p`` stage-microbatches, 1F1B's ``p`` full ones.

The order follows the paper's hand-made schedule (the one torch.distributed.pipelining's
ScheduleZBVZeroBubble builds): the warmup fills both legs of the V, the steady phase alternates
``F B W`` on the two local stages, and the cooldown postpones W's into the drain's gaps. With fewer
than ``2p - 1`` microbatches the order for ``2p - 1`` is built and the missing microbatches dropped.
"""
from __future__ import annotations

from autopar.runtime.schedules._common import B, F, W, check_count
from autopar.runtime.schedules.action import Action, Schedule

__all__ = ["zb_v"]


def zb_v(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """The ZB-V schedule: ``2 * num_ranks`` stages in a V, backward split into B and W."""
    p = check_count("zb_v", "num_ranks", num_ranks)
    m = check_count("zb_v", "num_microbatches", num_microbatches)
    rows = []
    for rank in range(p):
        padded = _rank_actions(rank, p, max(m, 2 * p - 1))
        rows.append(tuple(a for a in padded if a.microbatch < m))
    return Schedule(
        name="zb_v", num_ranks=p, num_stages=2 * p, num_microbatches=m,
        stage_to_rank=tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)),
        actions=tuple(rows), split_backward=True,
    )


def _rank_actions(rank: int, p: int, m: int) -> list[Action]:
    """Rank ``rank``'s order for ``m >= 2p - 1`` microbatches; ``down``/``up`` are its two stages."""
    down, up = rank, 2 * p - 1 - rank
    count = {key: 0 for key in ("f0", "f1", "b0", "b1", "w0", "w1")}
    row: list[Action] = []

    def emit(kind, stage: int, key: str) -> None:
        row.append(kind(stage, count[key]))
        count[key] += 1

    for _ in range(2 * (p - rank) - 1):  # warmup: fill the down leg
        emit(F, down, "f0")
    for _ in range(rank):  # the first microbatches come back up
        emit(F, up, "f1")
        emit(F, down, "f0")
    for _ in range(p - rank):  # the up leg starts draining
        emit(F, up, "f1")
        emit(B, up, "b1")
        emit(W, up, "w1")
    while count["f1"] < count["f0"] or count["f0"] < m:  # steady: F B W on both stages
        if count["f0"] < m:
            emit(F, down, "f0")
        emit(B, down, "b0")
        emit(W, down, "w0")
        emit(F, up, "f1")
        emit(B, up, "b1")
        emit(W, up, "w1")
    for _ in range(rank):  # cooldown: input gradients first, W's fill the gaps
        emit(B, down, "b0")
        emit(B, up, "b1")
    for _ in range(p - rank):
        emit(B, down, "b0")
        emit(W, down, "w0")
    while count["w1"] < count["b1"]:
        emit(W, up, "w1")
    while count["w0"] < count["b0"]:
        emit(W, down, "w0")
    assert count["f0"] == count["b0"] == count["w0"] == count["f1"] == count["b1"] == count["w1"] == m
    return row
