"""The bound of a symbolic sequence dim: the longest sequence a batch may hold, and where it comes from.

A graph captured with a symbolic sequence (:mod:`autopar.passes.frontend.dynamic_capture`) runs any length
the model's code allows; a batch past the bound is refused before any rank runs it
(:mod:`autopar.runtime.execution.shape_cache`), with autopar's error naming the dim, the length and the fix.
The bound is the user's ``max_seq_len`` when given, else the least of:

- what export proved from the model's code (a position buffer sliced by the length: BERT's);
- the longest sequence whose computed positions stay inside the position tables they index
  (:func:`autopar.passes.frontend.index_bounds.position_limit`: GPT-2's ``wpe``, OPT's offset table);
- the config's own maximum (``max_position_embeddings``; transformers maps ``n_positions`` onto it).

A ``max_seq_len`` past one of the first two (hard limits) is a PlanError; past the config's maximum
it is taken (rotary models extrapolate). Under sequence parallelism a length must also divide by tp.

:func:`bound_dynamic_dims` is the lowering's pass (after the capture's checks) that writes the bounds
into ``captured.dynamic`` and the Plan (``dynamic_dims``, ``max_seq_len``, ``max_seq_len_source``).

Example::

    >>> import torch.nn as nn
    >>> class Config:
    ...     max_position_embeddings = 64
    >>> model = nn.Linear(2, 2)
    >>> model.config = Config()
    >>> model_max_length(model)
    (64, "the model's max_position_embeddings")
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError
from autopar.ir.dynamic_shapes import DynamicDim
from autopar.passes.frontend.dynamic_capture import sequence_dims
from autopar.passes.frontend.index_bounds import position_limit
from autopar.passes.lowering_state import LoweringState
from autopar.plan_model import DynamicDimPlan

__all__ = ["model_max_length", "bound_dims", "bound_dynamic_dims", "padded_to"]


#: config fields that name a model's longest sequence (transformers maps n_positions, n_ctx onto the first)
_MAX_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_len")


def model_max_length(model: nn.Module) -> tuple[int, str] | None:
    """(the longest sequence the model's config names, which field), from the first module with a config."""
    for module in model.modules():
        config = getattr(module, "config", None) or getattr(module, "cfg", None)
        for name in _MAX_LENGTH_FIELDS:
            value = getattr(config, name, None) if config is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"the model's {name}"
    return None


def _seq_bound(dim: DynamicDim, *, model, gm, max_seq_len: int | None) -> tuple[int | None, str]:
    """The bound of a sequence dim: the user's ``max_seq_len`` within the hard limits (export's range, the
    position tables), else the least of those and the config's maximum."""
    hard = [(dim.high, dim.bound_source)] if dim.high is not None else []
    table = position_limit(gm, set(dim.inputs))
    hard += [table] if table else []
    if max_seq_len is not None:
        over = [(h, source) for h, source in hard if max_seq_len > h]
        if over:
            h, source = min(over)
            raise PlanError(f"max_seq_len={max_seq_len} is past what the model can take: {h} ({source})",
                            where="compile(max_seq_len=...)", fix=f"use max_seq_len <= {h}")
        return max_seq_len, "max_seq_len"
    soft = model_max_length(model)
    candidates = hard + ([soft] if soft else [])
    return min(candidates) if candidates else (None, "")


def bound_dims(dims: tuple[DynamicDim, ...], *, model: nn.Module, gm: fx.GraphModule, max_seq_len: int | None,
               seq_multiple: int, example_sizes: Mapping[str, int], rows: int | None = None) -> tuple[DynamicDim, ...]:
    """``dims`` with their bounds (sequence dims: :func:`_seq_bound`; rows: ``rows``, the microbatch size)
    and the multiple the plan needs.

    ``example_sizes``: {symbol: the example's size}; a bound below it is a PlanError.
    """
    out = []
    for dim in dims:
        if dim.label == "rows":
            out.append(dataclasses.replace(dim, low=1, high=rows, bound_source="the compiled microbatch size"))
            continue
        if dim.label != "seq":
            out.append(dim)
            continue
        high, source = _seq_bound(dim, model=model, gm=gm, max_seq_len=max_seq_len)
        example = example_sizes.get(dim.symbol)
        if high is not None and example is not None and example > high:
            raise PlanError(f"the example batch holds sequences of {example} tokens, past the bound {high} ({source})",
                            where=f"example_inputs, {dim.describe()}",
                            fix=f"compile on a batch of at most {high} tokens, or raise max_seq_len")
        out.append(dataclasses.replace(dim, high=high, bound_source=source if high is not None else "",
                                       multiple_of=seq_multiple))
    return tuple(out)


def bound_dynamic_dims(st: LoweringState) -> LoweringState:
    """The analysis pass after the capture's checks: ``captured.dynamic`` with their bounds (:func:`bound_dims`),
    and the Plan's ``dynamic_dims``, ``max_seq_len`` and ``max_seq_len_source``: the bound of the symbolic
    sequence, else the user's ``max_seq_len``, else the model's own maximum (what the runtime checks a batch
    built on its own against)."""
    plan, captured, model = st.plan, st.captured, st.source.model
    user = plan.max_seq_len if plan.max_seq_len_source == "max_seq_len" else None
    dims = captured.dynamic
    if dims:
        names = captured.input_names
        sizes = {d.symbol: int(st.example_args[names.index(d.inputs[0][0])].shape[d.inputs[0][1]]) for d in dims}
        dims = bound_dims(dims, model=model, gm=st.gm, max_seq_len=user, rows=plan.microbatch_size,
                          seq_multiple=plan.mesh.tp if plan.sequence_parallel else 1, example_sizes=sizes)
    seq = [(d.high, d.bound_source) for d in dims if d.label == "seq" and d.high is not None]
    known = (user, "max_seq_len") if user else model_max_length(model)
    bound, source = seq[0] if seq else known or (None, "")
    recorded = tuple(DynamicDimPlan(label=d.label, inputs=d.inputs, low=d.low, high=d.high, multiple_of=d.multiple_of,
                                    bound_source=d.bound_source) for d in dims)
    plan = plan.model_copy(update={"dynamic_dims": recorded, "max_seq_len": bound, "max_seq_len_source": source})
    return dataclasses.replace(st, plan=plan, captured=dataclasses.replace(captured, dynamic=dims))


def padded_to(inputs, target, length: int):
    """(inputs, target) with their sequence dim (:func:`autopar.passes.frontend.dynamic_capture.sequence_dims`) padded
    with zeros to ``length``: the batch the planner costs when batches may be as long as the bound.
    ``inputs``: a tuple of tensors or a dict batch; unchanged when no sequence is shorter than ``length``."""
    keys = list(inputs) if isinstance(inputs, Mapping) else None
    values = tuple(inputs.values()) if keys is not None else tuple(inputs)
    marks = sequence_dims(values, target)

    def pad(i, t):
        if i not in marks or t.shape[1] >= length:
            return t
        extra = list(t.shape)
        extra[1] = length - t.shape[1]
        return torch.cat([t, torch.zeros(extra, dtype=t.dtype, device=t.device)], dim=1)

    padded = tuple(pad(i, t) for i, t in enumerate(values))
    new_target = pad(len(values), target) if target is not None else None
    return (dict(zip(keys, padded)) if keys is not None else padded), new_target
