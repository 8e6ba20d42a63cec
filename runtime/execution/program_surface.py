"""What every program kind offers over its parts: reading, batches, the weights, checkpoints.

A program is made of :class:`~autopar.runtime.execution.rank_parts.RankParts` (built once, by
:func:`~autopar.runtime.execution.rank_parts.build_parts`) and runs them its own way:
:class:`~autopar.runtime.execution.program.RankProgram` (the synchronous schedules),
:class:`~autopar.runtime.execution.async_pipeline.AsyncProgram` (a pipeline that never drains) and
:class:`~autopar.runtime.execution.data_parallel.DataParallelProgram` (everything through dp rank 0).
:class:`ProgramSurface` holds what they share: the parts as attributes (what
:class:`~autopar.runtime.execution.rank_context.ProgramState` names, read by checkpoints, the non-finite
check, clipping and the memory probe), the stage graphs to read, this rank's slice of a batch,
the full state dict and checkpoints. Each kind adds its ``train_step`` and its forward.

Every program keeps this rank's flight record (``program.flight``, :mod:`autopar.ops.flight_record`:
its last actions, collectives and transfers) and, on a world of two ranks or more, watches the job
(``program.watch``, :mod:`autopar.runtime.diagnostics.flight_watch`): heartbeats, and the job-wide diagnosis when
a collective or a transfer fails. ``flight_record=0`` turns both off; ``run_dir`` keeps the record in
a file that outlives the process and receives the report.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopar.errors import PlanError
from autopar.ops.flight_record import STEP, FlightRecord
from autopar.ops.zero3_ops import full_parameters
from autopar.runtime.checkpoints.checkpoint import load_checkpoint, load_full_state_dict, save_checkpoint
from autopar.runtime.execution.cp_batch import cut_sequence, item_count_of, join_sequence
from autopar.runtime.execution.executor import run_actions
from autopar.runtime.diagnostics.flight_watch import start_watch
from autopar.runtime.execution.graft import graft
from autopar.runtime.execution.item_count import add_item_counts, add_loss_weights
from autopar.runtime.state.moe_groups import full_expert_parameters
from autopar.runtime.state.param_groups import GroupTemplate
from autopar.runtime.execution.rank_context import MeshInfo, RankContext
from autopar.runtime.execution.rank_parts import LoweredStages, build_parts
from autopar.runtime.state.rank_tensors import model_buffers
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.forward_only import forward_only
from autopar.runtime.state.state import gather_full_state_dict
from autopar.runtime.execution.step_batches import StepBatches
from autopar.runtime.execution.step_report import StepReport, batch_counts

__all__ = ["ProgramSurface"]


class ProgramSurface:
    """This rank's parts of the compiled program, and what every way of running them shares."""

    def __init__(self, *, lowered: LoweredStages, info: MeshInfo, schedule: Schedule, optimizer_factory,
                 state_keys: tuple[str, ...], masters: dict | None = None, materialize=None,
                 unused: tuple = (), param_groups: GroupTemplate | None = None, builder=None):
        """``lowered``: one tp rank's lowering; ``masters``: fp32 masters of bf16 graphs; ``materialize``:
        fills a meta-built model's pieces (runtime/state/materialize.py); ``unused``: the model's tensors no
        stage graph reads, kept whole (runtime/state/unused_state.py). How the run behaves is the Plan's ``run``
        (:class:`autopar.plan_model.RunOptions`): ``p2p_timeout_s`` bounds every collective, ``flight_record``
        entries of the rank's flight record (0: none, and no job watch), ``run_dir`` where its file and the
        diagnosis go, ``shape_cache_size`` how many batch shapes compiled on their own are kept;
        ``param_groups``: the optimizer factory's groups over the whole model (runtime/state/param_groups.py;
        None: those of this rank's own parameters); ``builder``: lowers this rank's stages for another
        batch shape (autopar/shape_builder.py; None: only the compiled shapes run)."""
        self.phase = "schedule"  # what the step is doing, for errors (the action itself while the schedule runs)
        run = lowered.plan.run
        p2p_timeout_s, flight_record, run_dir = run.p2p_timeout_s, run.flight_record, run.run_dir
        world = dist.get_world_size() if dist.is_initialized() else info.shape.world_size
        self.flight = FlightRecord(rank=info.rank, capacity=flight_record, folder=run_dir,
                                   meta={"world": world, "coords": dict(info.coords)}) if flight_record > 0 else None
        # the rank's groups, its collectives' deadline (naming what it is doing) and its dp traffic log
        self.ctx = RankContext.create(info, timeout_s=p2p_timeout_s, place=self._place, flight=self.flight)
        self.parts = parts = build_parts(lowered=lowered, ctx=self.ctx, schedule=schedule,
                                         optimizer_factory=optimizer_factory, state_keys=state_keys,
                                         masters=masters, materialize=materialize, param_groups=param_groups)
        self.plan, self.info, self.schedule, self.captured = parts.plan, info, schedule, parts.captured
        self.state_keys, self.stages, self.stage_ranks = state_keys, parts.stages, parts.stage_ranks
        self.comm_guard, self.comm_log, self.channel = self.ctx.guard, self.ctx.comm_log, parts.channel
        self.named_params, self.mixed, self.optimizer = parts.named_params, parts.mixed, parts.optimizer
        self.index_guard, self.aliases = parts.index_guard, parts.aliases
        self.unused = unused  # saved, loaded and taken out with the weights; never trained
        self.last_stage_rank = self.stage_ranks[len(self.stage_ranks) - 1]
        self.events: list = []
        self.step_count = 0  # completed optimizer steps (saved and restored by checkpoints)
        self.zero3_runtimes = tuple(parts.zero3)  # (graphs built for other shapes add theirs)
        # microbatches, their stage graphs per shape and the schedule per count (runtime/execution/step_batches.py)
        self.batching = StepBatches(self, example_shapes=getattr(lowered, "example_shapes", {}), build=builder,
                                    cache_size=run.shape_cache_size)
        self.last_step: StepReport | None = None  # what the last train_step reports (runtime/execution/step_report.py)
        self.watch = None  # heartbeats and the job-wide diagnosis (runtime/diagnostics/flight_watch.py)
        if self.flight is not None:
            self.flight.set_meta(stages=sorted(self.stages))
            self.watch = start_watch(self.flight, world=world, run_dir=run_dir, timeout_s=p2p_timeout_s)
            self.comm_guard.on_failure = self.watch.on_failure if self.watch is not None else None

    def _flight_step(self) -> None:
        """Mark the start of a training step in the flight record (numbered from 1, as errors name steps)."""
        if self.flight is not None:
            self.flight.step = self.step_count + 1
            self.flight.end(self.flight.begin(STEP, "step"))

    # -- what a person reads -------------------------------------------------------------
    @property
    def graphs(self) -> dict[int, torch.fx.GraphModule]:
        """This rank's rewritten stage graphs, by stage index."""
        return {s: st.gm for s, st in sorted(self.stages.items())}

    def _report(self, loss: torch.Tensor, *, lrs: tuple[float, ...], grad_norm: float | None, inputs: tuple,
                start: float, dp: int | None = None) -> None:
        """Set ``program.last_step`` (runtime/execution/step_report.py); ``inputs``: the graph's inputs of this rank's
        slice (the target last when compiled with a loss_fn), one of ``dp`` (default: the mesh's) equal ones."""
        model_inputs = inputs[:-1] if self.captured.has_target else inputs
        samples, tokens = batch_counts(model_inputs, dp=self.plan.mesh.dp if dp is None else dp)
        self.last_step = StepReport(step=self.step_count, loss=float(loss), lrs=lrs, grad_norm=grad_norm,
                                    num_samples=samples, num_tokens=tokens, seconds=time.perf_counter() - start)

    # -- batches and collectives' errors -----------------------------------------------------
    def _microbatches(self, tensors: tuple) -> list[dict]:
        """A full batch of the compiled shapes (or their symbolic family) as microbatches: the asynchronous
        programs' batches, which take neither fewer rows nor shapes compiled on their own."""
        batches, stages = self.batching.cut(tensors)
        if len(batches) != self.batching.count or any(s is not self.stages for s in stages):
            first = {name: tuple(t.shape) for name, t in batches[0].items()} if batches else {}
            raise PlanError(f"this asynchronous program runs full batches of the compiled shapes; this rank's batch "
                            f"makes {len(batches)} microbatches (of {self.batching.count}), the first shaped {first}",
                            where=f"rank {self.info.rank}, train_step",
                            fix="drop the last, partial batch (DataLoader(..., drop_last=True)) and pad every batch to "
                                "the compiled shapes, or compile with dynamic_shapes='seq' (any sequence length), or "
                                "use a synchronous schedule")
        return batches

    def _bind_lowered(self, lowered) -> dict:
        """Stage graphs built for another batch shape, sharing this program's state (runtime/execution/graft.py)."""
        stages, runtimes = graft(lowered.stages, base=self.stages, ctx=self.ctx, channel=self.channel)
        self.zero3_runtimes += runtimes
        if hasattr(self, "grad_sync"):
            self.grad_sync.zero3_runtimes = self.zero3_runtimes
        return stages

    def _batch(self, inputs: tuple, target, where: str) -> tuple:
        """The graph's inputs in order, from tensors or from one dict batch (its keyword inputs)."""
        keywords = self.captured.keywords
        if keywords is not None:
            if len(inputs) != 1 or not isinstance(inputs[0], dict):
                raise PlanError("this program was compiled on a dict batch", where=where,
                                fix=f"pass one dict with the keys {list(keywords)}")
            missing = [k for k in keywords if k not in inputs[0]]
            if missing:
                raise PlanError(f"the batch lacks {missing}", where=where,
                                fix=f"pass the keys the program was compiled with: {list(keywords)}")
            inputs = tuple(inputs[0][k] for k in keywords)
        if self.captured.has_target:
            if target is None:
                raise PlanError("this program was compiled with a loss_fn: the step needs its target", where=where,
                                fix="pass target= (this rank's dp slice of the targets)")
            inputs = tuple(inputs) + (target,)
        return self._cp_cut(tuple(inputs), where)

    def _cp_cut(self, tensors: tuple, where: str) -> tuple:
        """With cp: each sequence input cut to this rank's part (runtime/execution/cp_batch.py)."""
        if self.plan.mesh.cp == 1:
            return tensors
        spec = self.captured.item_count
        names = tuple(n for n in self.captured.input_names if spec is None or n != spec.input)
        return cut_sequence(tensors, names, plan=self.plan, rank=self.info.coords["cp"], where=where)

    def _count_items(self, batches: list[dict], per_update: int | None = None) -> list[dict]:
        """The model's own loss divides by the step's label tokens: each microbatch gets its share
        (runtime/execution/item_count.py; one all-reduce over dp). ``per_update``: microbatches per update (all)."""
        spec = item_count_of(self.captured.item_count, self.plan)  # (cp: labels shifted before the cut)
        if spec is not None:
            add_item_counts(batches, spec, per_update=per_update or len(batches), dp_size=self.plan.dims.dcp,
                            dp_group=self.info.group("dcp"), guard=self.comm_guard)
        weight = self.captured.loss_weight  # a token-mean loss_fn (passes/frontend/mean_loss.py): per update
        if weight is not None and weight.labels in batches[0]:  # (not forward-only)
            add_loss_weights(batches, weight, per_update=per_update, dp_size=self.plan.dims.dcp,
                             dp_group=self.info.group("dcp"), guard=self.comm_guard)
        return batches

    def shard_batch(self, tensor):
        """This rank's dp slice of a global batch (a tensor, or each tensor of a dict batch): the rows cut as
        evenly as they come (a last batch of 6 rows over dp=4: 2, 2, 1, 1)."""
        if isinstance(tensor, dict):
            return {k: self.shard_batch(v) for k, v in tensor.items()}
        return tensor.tensor_split(self.plan.mesh.dp, dim=0)[self.info.coords["dp"]]

    def _place(self) -> str:
        """Where this rank is, for a collective's error: its stages and the action or phase running."""
        if not hasattr(self, "channel"):  # while the parts are being built
            return "building the program"
        stages = ", ".join(str(s) for s in sorted(self.stages))
        doing = f"action {self.channel.action}" if self.phase == "schedule" else self.phase
        return f"stage {stages}, {doing}"

    def _shared_params(self) -> list:
        """(parameter, global ranks holding a copy) of the weights tied across pipeline ranks."""
        shared = []
        for name, stages in self.plan.shared_params.items():
            ranks = sorted({self.stage_ranks[s] for s in stages})
            if self.info.rank in ranks and len(ranks) > 1:
                shared.append((dict(self.named_params)[name], ranks))
        return shared

    # -- forward only (RankProgram's and AsyncProgram's ``program(...)``) -----------------------
    @functools.cached_property
    def inference_schedule(self) -> Schedule:
        """Replica 0's stages, depth first, F only (runtime/schedules/forward_only.py)."""
        return forward_only(self.schedule)

    @property
    def output_rank(self) -> int:
        """The rank of the last part's stage: it broadcasts the forward's outputs."""
        return self.stage_ranks[self.schedule.parts - 1]

    def _forward_only(self, inputs: tuple):
        """The model's output for this rank's batch, on every rank (call under ``torch.no_grad``)."""
        batches, stages = self.batching.cut(self._batch(inputs, None, "program(...)")
                                            if self.captured.keywords else self._cp_cut(tuple(inputs), "program(...)"))
        batches = self._count_items(batches)
        self.phase = "index range check"
        self.index_guard.agree(self.index_guard.inspect(batches), guard=self.comm_guard, rank=self.info.rank,
                               step="a forward-only call")
        self.phase = "schedule"
        schedule = self.inference_schedule if len(batches) == self.batching.count else forward_only(
            self.batching.schedule_for(len(batches)))
        results = run_actions(schedule.actions[self.info.coords["pp"]], stages=stages, microbatches=batches,
                              channel=self.channel, train=False)
        payload = [None]
        if results:
            flat = [pytree.tree_flatten(results[i])[0] for i in sorted(results)]
            payload = [[torch.cat(parts, dim=0) for parts in zip(*flat)]]
        if self.plan.mesh.pp > 1:
            self.phase = "output broadcast"
            self.comm_guard.call("broadcast_object_list", dist.broadcast_object_list, payload, src=self.output_rank,
                                 group=self.info.groups["pp"], purpose="the forward's outputs")
        outputs = pytree.tree_unflatten(payload[0], self.captured.out_spec)
        return join_sequence(outputs, plan=self.plan, group=self.info.group("cp"), guard=self.comm_guard)

    def flush(self) -> None:
        """Finish the work in flight before the process group goes: nothing for a synchronous program,
        whose steps end drained; an asynchronous one (runtime/execution/async_pipeline.py) runs its pending
        backwards and updates and waits for its sends."""

    # -- the weights ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as the original (single-device) model names them, on every rank."""
        named = full_parameters(self.parameter_values(), [s.gm for s in self.stages.values()])
        if self.plan.expert_parallel > 1:  # every ep rank's experts (runtime/state/moe_groups.py)
            named = full_expert_parameters(list(named), experts=self.plan.expert_params, group=self.info.groups["ep"],
                                           guard=self.comm_guard)
        unused = [(u.name, u.tensor) for u in self.unused]  # (runtime/state/unused_state.py)
        return gather_full_state_dict(list(named) + model_buffers(self) + unused, plan=self.plan, info=self.info,
                                      aliases={**self.aliases, **{u.name: u.aliases for u in self.unused}},
                                      keys=self.state_keys)

    def parameter_values(self) -> list[tuple[str, torch.Tensor]]:
        """(name, value) of every parameter this rank holds, fp32 masters under mixed precision, where
        ZeRO-1/2 keep a master only on the parameter's owner: the others are fetched (collective over dp)."""
        if self.mixed is None:
            return self.named_params
        return self.optimizer.owners_values(self.named_params)

    # -- checkpoints (runtime/checkpoints/checkpoint.py); collective: every rank calls them ----------------
    def save_checkpoint(self, root: str, *, extra=None) -> str:
        """Save weights, buffers, optimizer state and groups, step, and the state of each ``extra`` object
        ({name: object with state_dict()}, e.g. a scheduler) under ``root`` (atomically); the step folder."""
        return save_checkpoint(self, root, extra=extra)

    def load_checkpoint(self, path: str, *, extra=None) -> int:
        """Load ``root``'s latest checkpoint (or one step folder), saved on any mesh, and each ``extra``
        object's state (saved under the same name); returns its step."""
        step = load_checkpoint(self, path, extra=extra)
        if self.mixed is not None:  # round the masters into the bf16 copies; ZeRO-1/2 owners broadcast them
            self.optimizer.publish_parameters()
        return step

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Set the weights from a single-device ``state_dict`` (``model.state_dict()``)."""
        load_full_state_dict(self, state_dict)
        if self.mixed is not None:
            self.optimizer.publish_parameters()
