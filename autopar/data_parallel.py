"""``compile(data_parallel="dataparallel")``: the DataParallel baseline's entry, next to :func:`autopar.compile`.

The model is lowered without its loss (dp rank 0 computes it over the gathered outputs) into one
stage, and this rank's :class:`autopar.runtime.execution.data_parallel.DataParallelProgram` runs it
(``docs/data_parallel.md``). Only pp=1, one microbatch and no ZeRO apply.
"""
from __future__ import annotations

from collections.abc import Mapping

from autopar.errors import PlanError
from autopar.lowering import lower, resolve
from autopar.runtime.execution.data_parallel import DataParallelProgram
from autopar.runtime.schedules.registry import build_schedule

__all__ = ["compile_data_parallel"]


def _check(info, opts, loss_fn, example_inputs) -> None:
    if info.shape.pp > 1:
        raise PlanError(f"data_parallel='dataparallel' runs one pipeline stage, but the mesh has pp={info.shape.pp}",
                        where="compile(data_parallel='dataparallel')",
                        fix="use pp=1, or data_parallel='ddp' (the default), which composes with pp")
    if loss_fn is None and isinstance(example_inputs, Mapping) and "labels" in example_inputs:
        raise PlanError("data_parallel='dataparallel' computes the loss on rank 0 from the gathered outputs: "
                        "it cannot train on the loss the model computes from `labels`",
                        where="compile(data_parallel='dataparallel', example_inputs={..., 'labels': ...})",
                        fix="use data_parallel='ddp' (the default) for the model's own loss, or pass loss_fn= and "
                            "example_target= (the labels) with a batch without 'labels'")
    if loss_fn is None:
        raise PlanError("data_parallel='dataparallel' is a training baseline and needs a loss",
                        where="compile(data_parallel='dataparallel')", fix="pass loss_fn= and example_target=")
    if "zero_stage" in opts.model_fields_set and opts.zero_stage != 0:
        raise PlanError(f"zero_stage={opts.zero_stage} does not apply to data_parallel='dataparallel' "
                        f"(rank 0 holds the whole optimizer)", where="compile(zero_stage=...)",
                        fix="drop zero_stage, or use data_parallel='ddp' for ZeRO")
    if opts.num_microbatches not in (None, 1):
        raise PlanError("data_parallel='dataparallel' runs the batch in one pass",
                        where=f"compile(num_microbatches={opts.num_microbatches})", fix="drop num_microbatches")


def compile_data_parallel(model, *, info, opts, example_inputs, example_target, loss_fn, optimizer_factory,
                          plan=None, pinned: bool = False, param_groups=None) -> "DataParallelProgram":
    """Lower ``model`` without its loss (rank 0 computes it) and build this rank's DataParallel program.

    ``plan``: the resolved Plan (its one stage, one pass and no ZeRO are the baseline's:
    :func:`autopar.options.resolve_plan`); resolved here when this is called on its own."""
    _check(info, opts, loss_fn, example_inputs)
    if plan is None:
        plan = resolve(model, mesh=info.shape, example_inputs=example_inputs, options=opts)
    lowered = lower(model, plan=plan, pinned=pinned, tp_rank=info.coords["tp"], example_inputs=example_inputs,
                    loss_fn=None, options=opts)
    schedule = build_schedule("gpipe", num_ranks=1, num_microbatches=1, num_virtual=1)
    return DataParallelProgram(lowered=lowered, info=info, schedule=schedule, optimizer_factory=optimizer_factory,
                               state_keys=tuple(model.state_dict().keys()), loss_fn=loss_fn,
                               param_groups=param_groups)
