"""Stage graphs for batches of other shapes than the example's: the capture kept, captured again, lowered.

``compile`` lowers the model once, at the example's microbatch shape (:func:`lower_program`), and
hands the runtime a *builder* (:func:`make_builder`) that lowers this rank's stages again for
another shape: the model captured again under the lowered (pinned) Plan, so the stage cuts,
tensor-parallel regions and shards are the same and the new graphs hold the same tensors under the
same names (``runtime/execution/graft.py`` points them at the compiled graphs' own). The runtime decides
when (``runtime/execution/shape_cache.py``): once with the dims that changed symbolic, else per shape.
"""
from __future__ import annotations

import dataclasses
import logging

import torch.nn as nn

from autopar.errors import PassError, ShardingError
from autopar.lowering import Captured, Lowered, capture_planned, capture_source, lower_captured
from autopar.options import CompileOptions
from autopar.plan_model import Plan

__all__ = ["lower_program", "recapture", "make_builder"]

log = logging.getLogger(__name__)


def lower_program(model: nn.Module, *, plan: Plan, pinned: bool, tp_rank: int, example_inputs, example_target=None,
                  loss_fn=None, options: CompileOptions, dp_rank: int = 0, stages=None,
                  cp_rank: int = 0) -> tuple[Captured, Lowered]:
    """(the capture, its lowering for tp rank ``tp_rank``) under the resolved ``plan``: :func:`autopar.lowering.lower`,
    keeping the capture for :func:`recapture`. A graph whose symbolic dims a pass cannot carry is captured
    again with fixed shapes (logged): other shapes are then compiled on their own (runtime/execution/shape_cache.py)."""
    common = dict(plan=plan, pinned=pinned, example_inputs=example_inputs, example_target=example_target,
                  loss_fn=loss_fn, options=options)
    cap = capture_planned(model, **common)
    if not cap.captured.dynamic:
        return cap, lower_captured(cap, tp_rank=tp_rank, stages=stages, copy=False, dp_rank=dp_rank, cp_rank=cp_rank)
    try:
        return cap, lower_captured(cap, tp_rank=tp_rank, stages=stages, dp_rank=dp_rank, cp_rank=cp_rank)
    except (PassError, ShardingError) as exc:
        log.warning("the symbolic %s could not be carried through the passes (%s): compiled for the example's "
                    "shapes; each other shape is compiled on its own", ", ".join(d.label for d in cap.captured.dynamic),
                    exc.what)
        cap = capture_planned(model, dynamic={}, **common)
        return cap, lower_captured(cap, tp_rank=tp_rank, stages=stages, copy=False, dp_rank=dp_rank, cp_rank=cp_rank)


def recapture(cap: Captured, lowered_plan: Plan, *, model: nn.Module, batch: dict | None, dynamic: dict) -> Captured:
    """``model`` captured again under ``cap``'s lowered (pinned) Plan, for another batch shape: the model
    phase of the lowering's passes (:func:`autopar.lowering.capture_source`) on the new microbatch.

    ``batch``: {graph input: microbatch tensor} to capture at (None: the example's microbatch);
    ``dynamic``: {graph input: dims} to keep symbolic. The stage cuts, regions and shards are the
    Plan's, so the new graphs hold the same tensors under the same names (runtime/execution/graft.py).
    """
    names = cap.captured.input_names
    example = dict(zip(names, cap.example_args))
    values = {**example, **(batch or {})}
    count = cap.captured.item_count.input if cap.captured.item_count is not None else None
    has_target = cap.captured.has_target
    inputs = [n for n in names if n != count and not (has_target and n == names[-1])]
    order = inputs + ([names[-1]] if has_target else [])
    source = dataclasses.replace(cap.source, model=model, inputs=tuple(values[n] for n in inputs),
                                 target=values[names[-1]] if has_target else None,
                                 dynamic={order.index(n): tuple(dims) for n, dims in dynamic.items() if n in order})
    return capture_source(source, plan=lowered_plan, pinned=True, options=cap.options)


def make_builder(cap: Captured, lowered: Lowered, *, model: nn.Module, tp_rank: int, dp_rank: int,
                 stages: list[int], cp_rank: int = 0):
    """``build(batch or None, marks) -> Lowered``: this rank's ``stages`` lowered again (:func:`recapture`)."""

    def build(batch, marks):
        new = recapture(cap, lowered.plan, model=model, batch=batch, dynamic=marks)
        return lower_captured(new, tp_rank=tp_rank, stages=stages, copy=False, dp_rank=dp_rank, cp_rank=cp_rank)

    return build
