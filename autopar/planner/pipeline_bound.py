"""Lower bounds on a pipeline's simulated step time, from per-stage costs alone (no action list).

The search ranks thousands of candidates by these bounds and simulates them best-first
(:mod:`autopar.planner.search`), so a bound must never exceed what
:func:`autopar.runtime.schedules.simulator.simulate` (or, ranks sharing cores,
:func:`~autopar.runtime.schedules.shared_cores.simulate_shared_cores`) gives for the same costs.
It holds for *every* schedule obeying the dependency rule of :mod:`autopar.runtime.schedules.deps`
with one model replica and one F, B (and W, split backward) per stage and microbatch: 1F1B,
GPipe, interleaved 1F1B, looped BFS, ZB-H1, ZB-H2, ZB-V. Each rank runs its actions one at a
time, so for a rank ``r`` holding stages ``R`` (lowest ``lo``, highest ``hi``), with ``m``
microbatches:

- it starts no earlier than the first microbatch's forward reaches ``lo``: ``head(lo)``;
- its first B needs the forward through every stage and the backward back to ``hi``: ``first_b``;
- its last B is at ``lo`` (a B at a higher stage of the same microbatch comes first, on the same
  rank), and after it the backward still runs down to stage 0, then stage 0's W: ``tail(lo)``;
- every F and B of the rank precedes the end of its last B, every B and W follows its first B.

So the step is at least ``head + m·work``, ``first_b + m·(B + W)``, ``first_b + m·B + tail`` and
``head + m·(F + B) + tail`` on every rank (p2p added where consecutive stages change rank). With
ranks sharing ``cores`` (processor sharing: a rank runs at most at its lone speed, all of them at
most ``cores`` lone speeds together), also all the work divided by ``cores``.
``tests/api/test_planner_bound.py`` checks the bound against both simulators on every covered
family over a grid of small pipelines with random costs.

    >>> pipeline_lower_bound(owner=(0, 1, 2, 3), forward=[1.0] * 4, backward=[1.0] * 4, weight=[1.0] * 4,
    ...                      p2p=0.0, num_microbatches=8, split_backward=False)   # 1F1B's (m + p - 1)·(F + B)
    33.0
"""
from __future__ import annotations

from collections.abc import Sequence

from autopar.runtime.schedules.registry import family, schedule_names

__all__ = ["COVERED_SCHEDULES", "pipeline_lower_bound", "relaxed_bound"]

COVERED_SCHEDULES = tuple(n for n in schedule_names() if family(n).bounded)  # the registry's Family.bounded


def pipeline_lower_bound(*, owner: Sequence[int], forward: Sequence[float], backward: Sequence[float],
                         weight: Sequence[float], p2p: float, num_microbatches: int, split_backward: bool,
                         cores: float | None = None) -> float:
    """A lower bound on the step time of any covered schedule with these per-stage costs (seconds).

    ``owner[s]``: the rank running stage ``s``; ``forward``, ``backward``, ``weight``: one
    microbatch's F, B and W on each stage, as :class:`~autopar.runtime.schedules.simulator.StageCosts`
    takes them (without a split backward, B costs ``backward + weight``); ``cores``: the cores the
    ranks share (None: a device each).
    """
    m, n = num_microbatches, len(owner)
    b_cost = [backward[s] + (0.0 if split_backward else weight[s]) for s in range(n)]
    w_cost = [weight[s] if split_backward else 0.0 for s in range(n)]
    hop = [p2p if owner[s] != owner[s + 1] else 0.0 for s in range(n - 1)]
    head = [0.0] * n  # earliest start of any F on stage s
    for s in range(1, n):
        head[s] = head[s - 1] + forward[s - 1] + hop[s - 1]
    forward_end = head[-1] + forward[-1]
    up = [0.0] * n  # from the end of the last stage's F to the earliest start of a B on stage s
    for s in range(n - 2, -1, -1):
        up[s] = up[s + 1] + b_cost[s + 1] + hop[s]
    down = [0.0] * n  # from the end of a B on stage s to the end of the step (the backward to 0, then W0)
    for s in range(1, n):
        down[s] = down[s - 1] + b_cost[s - 1] + hop[s - 1]
    down = [d + w_cost[0] for d in down]
    stages: dict[int, list[int]] = {}
    for s, r in enumerate(owner):
        stages.setdefault(r, []).append(s)
    bound, total = 0.0, 0.0
    for mine in stages.values():
        lo, hi = min(mine), max(mine)
        f = m * sum(forward[s] for s in mine)
        b = m * sum(b_cost[s] for s in mine)
        w = m * sum(w_cost[s] for s in mine)
        first_b = forward_end + up[hi]
        total += f + b + w
        bound = max(bound, head[lo] + f + b + w, first_b + b + w, first_b + b + down[lo], head[lo] + f + b + down[lo])
    if cores is not None:
        bound = max(bound, total / cores)
    return bound


def relaxed_bound(*, path: float, work: float, num_ranks: int, num_microbatches: int, num_virtual: int) -> float:
    """A lower bound that holds for *every* way of cutting the model into stages (used before cuts exist).

    ``path``: one microbatch's F and B (the B action's cost) summed over the whole model, at the
    fastest speed; ``work``: its F, B and W. With one stage per rank, the rank-``q`` bound
    ``head + m·(F + B) + tail`` reads ``Y_{<q} + m·y_q`` in the stage loads ``y``; over loads
    summing to ``path`` its maximum is at least ``path / (1 - (1 - 1/m)^pp)`` (equalise the terms).
    Always at least the mean rank's work ``m·work / pp`` and one microbatch's path.
    """
    m, pp = num_microbatches, num_ranks
    bound = max(m * work / pp, path)
    if num_virtual == 1 and pp > 1:
        bound = max(bound, path / (1.0 - (1.0 - 1.0 / m) ** pp))
    return bound
