"""A step's batch as the program runs it: microbatches, their stage graphs, the schedule, the dp agreement.

:class:`StepBatches` is what a program asks before it runs a step:

1. :meth:`cut`: this rank's batch checked and cut into microbatches (:mod:`autopar.runtime.execution.batch_split`:
   a partial batch gets fewer or smaller ones), each with the stage graphs of its shape
   (:mod:`autopar.runtime.execution.shape_cache`: the compiled graphs, their symbolic family, or graphs built
   for that shape);
2. :meth:`agree`: one all-reduce over dp (none with dp=1) of every rank's rows, refusals and token
   counts (:mod:`autopar.runtime.execution.batch_agreement`): a refused batch stops every rank with autopar's
   error, and a partial batch's rows are weighed as one device weighs them;
3. :meth:`schedule_for`: the schedule of that many microbatches (built and validated once per count).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, PlanError
from autopar.ops.collectives import GraphCollective
from autopar.runtime.execution.batch_agreement import StepRows, add_row_weights, agreement_riders, read_agreement
from autopar.runtime.execution.batch_split import FIX_PARTIAL, batch_rows, cut_rows, microbatch_rows
from autopar.runtime.execution.cp_batch import item_count_of
from autopar.runtime.execution.item_count import add_item_counts, add_loss_weights
from autopar.runtime.schedules.registry import build_schedule
from autopar.runtime.schedules.validator import validate
from autopar.runtime.execution.shape_cache import ShapeCache, ShapeEntry

__all__ = ["StepBatches"]


def _dp_collectives(stages: dict) -> bool:
    """Whether a stage graph communicates over dp inside its forward or backward (ZeRO-3 gathers, MoE
    all-to-all and router statistics): then every dp rank must run as many microbatches."""
    return any(isinstance(m, GraphCollective) and getattr(m, "axis", None) in ("dp", "edp", "edcp", "ep")
               for s in stages.values() for m in s.gm.modules())


class StepBatches:
    """One program's batches, shapes and schedules (module docstring)."""

    def __init__(self, program, *, example_shapes: dict, build=None, cache_size: int = 8):
        self.program = program
        plan = program.plan
        self.size, self.count = plan.microbatch_size, plan.pipeline.num_microbatches
        self.local = self.size * self.count
        spec = program.captured.item_count
        self.names = tuple(n for n in program.captured.input_names if spec is None or n != spec.input)
        base = ShapeEntry(shapes=dict(example_shapes), stages=program.stages,
                          dynamic=next((s.dynamic for s in program.stages.values()), ()))
        bound = (plan.max_seq_len, plan.max_seq_len_source) if plan.max_seq_len else None
        self.shapes = ShapeCache(base=base, build=build, bind=program._bind_lowered, mode=plan.dynamic_shapes,
                                 size=cache_size, where=self._where, bound=bound)
        self._schedules = {self.count: program.schedule}
        self.equal_counts = _dp_collectives(program.stages)

    def _where(self) -> str:
        info = self.program.info
        return f"rank {info.rank} (dp index {info.coords['dp']}), {self.program.phase}"

    # -- 1. cut --------------------------------------------------------------------------------
    def cut(self, tensors: tuple) -> tuple[list[dict], list[dict]]:
        """(microbatches, the stage graphs of each): raises autopar's error for a batch it cannot run."""
        names = self.names[:len(tensors)]  # (forward only: no target)
        rows = batch_rows(tensors, names, local=self.local, where=self._where())
        sizes = microbatch_rows(rows, size=self.size, count=self.count, takes=self.takes)
        batches = cut_rows(tensors, names, sizes)
        stages, last = [], None
        for batch in batches:
            key = tuple(tuple(batch[n].shape) for n in names)
            if last is None or key != last[0]:
                last = (key, self.shapes.stages_for(batch, names))
            stages.append(last[1])
        return batches, stages

    def takes(self, k: int) -> bool:
        """Whether the schedule runs ``k`` microbatches."""
        return self.schedule_for(k) is not None

    def schedule_for(self, k: int):
        """The Plan's schedule for ``k`` microbatches (None where the family cannot run that many)."""
        if k not in self._schedules:
            p = self.program.plan.pipeline
            try:
                schedule = build_schedule(p.schedule, num_ranks=self.program.plan.mesh.pp, num_microbatches=k,
                                          num_virtual=p.num_virtual)
                validate(schedule)
            except AutoparError:
                schedule = None
            self._schedules[k] = schedule
        return self._schedules[k]

    # -- 2. agree ------------------------------------------------------------------------------
    def agree(self, batches: list[dict] | None, problem: AutoparError | None, *, train: bool,
              per_update: int | None = None) -> StepRows:
        """Every dp rank's rows and refusals (one all-reduce over dp, the token counts on it); raises the
        step's error on every rank when any refused its batch. Sets the counts and weights in ``batches``.
        With cp, over dp x cp: each cp rank holds an equal part of its rows' positions, and its own tokens."""
        program, dp = self.program, self.program.plan.dims.dcp
        index = program.info.index("dcp")
        rows = sum(int(next(iter(b.values())).shape[0]) for b in batches) if batches else 0
        riders = agreement_riders(rows=rows, refused=problem is not None, dp_index=index, dp_size=dp,
                                  device=program.info.device)
        spec, weight = item_count_of(program.captured.item_count, program.plan), program.captured.loss_weight
        common = dict(dp_size=dp, dp_group=program.info.group("dcp"), guard=program.comm_guard, riders=riders)
        counted = spec is not None or (weight is not None and train)
        if batches is not None and spec is not None:
            riders = add_item_counts(batches, spec, per_update=per_update or len(batches), **common)
        elif batches is not None and weight is not None and train:
            riders = add_loss_weights(batches, weight, per_update=per_update, **common)
        elif dp > 1:
            updates = (self.count // per_update if per_update else 1) if counted else 0
            vector = torch.cat([torch.zeros(updates, dtype=torch.float64, device=riders.device), riders])
            program.comm_guard.run("all_reduce", dist.all_reduce, vector, group=program.info.group("dcp"),
                                   purpose="the step's rows on every dp rank (and its token counts)")
            riders = vector[updates:]
        step = read_agreement(riders, dp_size=dp)
        if problem is not None:
            raise problem
        if step.refused:
            bad = ", ".join(str(r) for r in step.refused)
            raise PlanError(f"dp rank {bad} refused its batch for this step, so no rank runs it", where=self._where(),
                            fix=f"see the error dp rank {bad} raised")
        self._check_counts(step)
        if train and spec is None and weight is None:
            add_row_weights(batches, step=step, dp_size=dp)
        return step

    def _check_counts(self, step: StepRows) -> None:
        """Graphs that communicate over dp per microbatch need the same microbatch count on every dp rank."""
        counts = [len(microbatch_rows(n, size=self.size, count=self.count, takes=self.takes)) for n in step.rows]
        if self.equal_counts and len(set(counts)) > 1:
            raise PlanError(f"the dp ranks' batches of {list(step.rows)} rows make {counts} microbatches, but this "
                            f"program's stage graphs communicate over dp in every microbatch (ZeRO-3's gathers, "
                            "mixture-of-experts exchanges), so every dp rank must run as many",
                            where=self._where(),
                            fix="pass every dp rank the same number of rows (program.shard_batch(global_batch) "
                                "cuts them evenly when the batch divides by dp), or " + FIX_PARTIAL.format(
                                    rows=self.local))
