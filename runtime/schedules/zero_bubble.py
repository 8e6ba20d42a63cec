"""ZB-H1 and ZB-H2 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3).

Both split backward into B (input gradient, on the critical path) and W (weight gradient, which
nothing downstream waits for) and use W to fill bubbles. Rank ``r`` runs stage ``r``. Each rank
runs ``warmup`` forwards, then repeats ``F B W`` (the W of an earlier microbatch), skipping the W of
its first ``delay`` iterations; the postponed W's run at the end, in the gaps of the drain.

- :func:`zb_h1`: 1F1B's warmup (``p - 1 - r``) and ``delay = r``. Rank memory never exceeds 1F1B's
  peak of ``p`` microbatches; with F = B = W the bubble is ``(p - 1) F``, a third of 1F1B's
  ``(p - 1)(F + B + W)``. This is torch.distributed.pipelining's ScheduleInterleavedZeroBubble with
  one stage per rank.
- :func:`zb_h2`: ``2 (p - 1 - r)`` warmup forwards fill the start-up bubble and ``delay = 2 r`` W's
  fill the drain, so every rank's span is exactly its work: with F = B = W and ``m >= 2p - 1`` the
  only idle time left is the pipeline fill ``(p - 1) F``, and none at all when steps overlap (the
  paper's parallelogram, which needs the optimizer step not to synchronize ranks). Each rank holds
  up to ``2p - 1`` microbatches' activations.
"""
from __future__ import annotations

from autopar.runtime.schedules._common import B, F, W, check_count, one_stage_per_rank
from autopar.runtime.schedules.action import Action, Schedule

__all__ = ["zb_h1", "zb_h2"]


def zb_h1(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order and memory, with W's postponed into the bubbles."""
    p = check_count("zb_h1", "num_ranks", num_ranks)
    m = check_count("zb_h1", "num_microbatches", num_microbatches)
    rows = [_rank_actions(r, m, warmup=p - 1 - r, delay=r) for r in range(p)]
    return one_stage_per_rank("zb_h1", num_ranks=p, num_microbatches=m, actions=rows, split_backward=True)


def zb_h2(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: extra warmup forwards and more postponed W's, for a bubble of only the pipeline fill."""
    p = check_count("zb_h2", "num_ranks", num_ranks)
    m = check_count("zb_h2", "num_microbatches", num_microbatches)
    rows = [_rank_actions(r, m, warmup=2 * (p - 1 - r), delay=2 * r) for r in range(p)]
    return one_stage_per_rank("zb_h2", num_ranks=p, num_microbatches=m, actions=rows, split_backward=True)


def _rank_actions(stage: int, m: int, *, warmup: int, delay: int) -> list[Action]:
    """``warmup`` forwards, then ``F B W`` per microbatch with the first ``delay`` W's moved to the end."""
    warmup = min(warmup, m)
    row = [F(stage, i) for i in range(warmup)]
    weights_done = 0
    for i in range(m):
        if warmup + i < m:
            row.append(F(stage, warmup + i))
        row.append(B(stage, i))
        if i >= delay:
            row.append(W(stage, weights_done))
            weights_done += 1
    row += [W(stage, i) for i in range(weights_done, m)]
    return row
