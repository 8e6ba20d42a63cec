"""The lowering's first graph-making pass: the model, as the Plan computes it, captured at microbatch shape.

:func:`capture_model` slices one microbatch off the example batch (the sizes baked into the graph are
the ones each rank runs), moves it to the meta device for a meta-built model, takes a bf16 copy of the
model when the Plan's precision is bf16 (passes/frontend/low_precision.py), captures only a few of a long list
of identical blocks when the options allow (passes/frontend/block_template.py), and traces it
(:func:`autopar.passes.frontend.capture.capture`), with the dims the source asks for symbolic, else, under the
Plan's ``dynamic_shapes="seq"``, the sequence dim of the batch's token inputs
(:func:`autopar.passes.frontend.dynamic_capture.sequence_dims`): ``captured.dynamic`` lists those that stayed so.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from autopar.passes.frontend.block_template import capture_blocks, find_block_template
from autopar.passes.frontend.capture import capture
from autopar.passes.frontend.dynamic_capture import sequence_dims
from autopar.passes.lowering_state import LoweringState
from autopar.passes.frontend.low_precision import low_precision_copy

__all__ = ["capture_model", "is_meta", "slice_batch"]


def is_meta(model: nn.Module) -> bool:
    """Is ``model`` built on the meta device (its parameters hold no storage)?"""
    return any(p.is_meta for p in model.parameters())


def slice_batch(tensors: tuple, size: int) -> tuple:
    """The first ``size`` rows of every tensor with a batch dim (others as they are)."""
    return tuple(t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in tensors)


def capture_model(st: LoweringState) -> LoweringState:
    """``captured`` and ``gm``: the model traced at microbatch shape; ``example_args``: the inputs it runs on
    (the microbatch, the inputs capture added, the target); ``template``: the identical blocks captured once."""
    src, plan = st.source, st.plan
    args = slice_batch(src.inputs, plan.microbatch_size)
    target = slice_batch((src.target,), plan.microbatch_size)[0] if src.target is not None else None
    if is_meta(src.model):
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
        target = target.to("meta") if isinstance(target, torch.Tensor) else target
    traced = low_precision_copy(src.model) if plan.precision == "bf16" else src.model  # bf16: capture bf16 code
    # identical blocks (an 80-layer list): capture a few, repeat the last one after sharding (repeat_blocks)
    template = find_block_template(traced, mode=st.options.block_capture,
                                   plan=plan if st.pinned else None)
    dynamic = src.dynamic  # the dims to keep symbolic (passes/frontend/dynamic_capture.py)
    if dynamic is None:
        dynamic = sequence_dims(args, target) if plan.dynamic_shapes == "seq" else {}
    captured, template = capture_blocks(template, lambda: capture(traced, args, loss_fn=src.loss_fn,
                                                                  example_target=target, mode=plan.capture,
                                                                  keywords=src.keywords, own_loss=src.own_loss,
                                                                  dynamic=dynamic))
    example_args = args + captured.extra_args + ((target,) if src.loss_fn is not None else ())
    return dataclasses.replace(st, source=dataclasses.replace(src, model=traced), captured=captured, gm=captured.gm,
                               template=template, example_args=example_args)
