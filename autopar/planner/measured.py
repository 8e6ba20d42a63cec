"""An estimate beside a measured step time: where the time goes, and which part most likely differs.

``autopar plan --explain`` prints :func:`explain_step` for the plan it estimates (with a mesh the user
pins, or a published run's own configuration: ``--published ID``): the step's additive parts (compute,
tensor-parallel communication, expert all-to-alls, the pipeline bubble, data-parallel communication,
the optimizer step, the fixed time per step), each in seconds and as a share, and, given the measured
step time (``--measured-step-s``), the difference and the part that would explain it with the least
surprise. Each part carries a typical relative error (:data:`SPREAD`): how far a part of that kind is
usually off in a model like this one (compute: the spread of the errors on the published runs the GPU
presets are fitted to; the others: assumed, see docs/planner.md). The part that explains the difference
alone with the smallest change, counted in its own spreads of the log (a part scales by a factor; none
can fall below zero), is named, with what each other part would have to change. One measured number
cannot tell two parts apart for certain: this is the likeliest single cause under those spreads.

    >>> from autopar.planner.cost_model import Candidate, Estimate
    >>> e = Estimate(Candidate(8, 16, 8, 192), step_time=35.0, parts={"compute": 30.0, "tp_comm": 2.0,
    ...              "bubble": 2.5, "p2p": 0.002, "dp_comm": 0.4, "optimizer": 0.1, "overhead": 0.0})
    >>> head, others = explain_step(e, measured=32.0)[-1].split(" (")
    >>> head
    'most likely compute: 30 s estimated, 10% less would explain it'
    >>> others.split(", ")[:2]
    ['tp comm would need -150%', 'the pipeline bubble would need -120%']
"""
from __future__ import annotations

import math

from autopar.planner.cost_model import Estimate

__all__ = ["PARTS", "SPREAD", "additive_parts", "explain_step"]

# the step's additive parts (Estimate.parts keys) and how they are named
PARTS = {"compute": "compute", "tp_comm": "tp comm", "ep_comm": "ep all-to-alls", "cp_comm": "cp attention traffic",
         "bubble": "the pipeline bubble",
         "dp_comm": "dp comm", "optimizer": "the optimizer step", "overhead": "the fixed time per step"}
# typical relative error of each part: compute from the published-run fit (docs/planner.md), the rest assumed
SPREAD = {"compute": 0.10, "tp_comm": 0.5, "ep_comm": 0.5, "cp_comm": 0.5, "bubble": 0.5, "dp_comm": 1.0,
          "optimizer": 1.0, "overhead": 1.0}


def additive_parts(e: Estimate) -> dict[str, float]:
    """The parts of ``e`` that add up to its step time (``p2p`` is one transfer, inside the bubble)."""
    return {k: e.parts.get(k, 0.0) for k in PARTS if e.parts.get(k, 0.0) > 0}


def explain_step(e: Estimate, *, measured: float | None = None) -> list[str]:
    """Lines: the estimate and its parts; with ``measured`` seconds, the difference and its likeliest part."""
    parts = additive_parts(e)
    lines = [f"estimated {e.step_time:.4g} s/step for {e.candidate.label()}: "
             + ", ".join(f"{PARTS[k]} {v:.3g} s ({v / e.step_time:.0%})" for k, v in parts.items())]
    if measured is None:
        return lines
    diff = measured - e.step_time
    lines.append(f"measured {measured:.4g} s/step: the estimate is {_signed(e.step_time / measured - 1)} "
                 f"({e.step_time - measured:+.3g} s)")
    if not parts or abs(diff) <= 1e-9 * measured:
        return lines
    change = {k: diff / v for k, v in parts.items()}
    # spreads a part alone would have to move (in log terms: a part scales, it cannot fall below zero)
    score = {k: abs(math.log1p(change[k])) / SPREAD[k] for k in parts if change[k] > -1}
    if not score:
        lines.append("no single part explains it: each would have to fall below zero")
        return lines
    best = min(score, key=score.get)
    others = ", ".join(f"{PARTS[k]} would need {_signed(change[k])}" for k in parts if k != best)
    more = "more" if diff > 0 else "less"
    lines.append(f"most likely {PARTS[best]}: {parts[best]:.3g} s estimated, {abs(change[best]):.0%} {more} would "
                 f"explain it" + (f" ({others})" if others else ""))
    if score[best] > 3:  # beyond three of its spreads: no one part explains it
        lines.append("no single part explains a difference this large: the cluster's figures are likely off for "
                     "this machine (measure them: autopar.planner.calibrate.calibrate, or describe the cluster)")
    return lines


def _signed(x: float) -> str:
    return f"{x * 100:+.0f}%" if abs(x) >= 0.1 else f"{x * 100:+.1f}%"
