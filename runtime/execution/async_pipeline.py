"""The runtime of the asynchronous schedules (PipeDream, PipeDream-2BW, PipeMare): a pipeline that never drains.

API (``program = autopar.compile(..., schedule="pipedream")`` returns an :class:`AsyncProgram`):

- ``program.train_step(*inputs, target=)`` feeds one batch (this rank's dp slice, split into
  ``num_microbatches`` microbatches) into the running pipeline and returns that batch's global
  mean loss on every rank. Its forwards have all run by then; the backwards of its last
  microbatches on the early stages, and the updates they feed, may still be in flight: they run
  during the next ``train_step`` calls, exactly as in a pipeline that never stops.
- ``program.flush()`` drains: every pending backward and update. ``full_state_dict()`` and
  ``save_checkpoint()`` flush first. Feeding more batches after a flush continues the same
  stream; loading weights (a checkpoint, a state dict) starts a new one from them.
- The numbers do not depend on how the stream is cut into calls: microbatches are numbered from
  the start of training, and what every forward and backward reads follows the schedule's
  :class:`~autopar.runtime.schedules.staleness.StalenessRule` of those numbers.
  tests/async_oracle.py computes the same training in one process, sharing no code with this one.

Each step of a rank (one stage per rank):

- F of microbatch ``i`` reads version ``rule.forward_version(s, i)``: with stashing, autograd
  records the forward on a snapshot of that version; PipeMare runs it without autograd on the
  live weights and keeps only the stage's inputs.
- B: stashing backpropagates through the recorded forward; PipeMare recomputes the stage's
  forward from its kept inputs with the corrected weights ``w - (v_b - v_f) * delta`` and
  backpropagates through that. The gradient goes into update ``rule.update_of(i)``.
- An update runs when its result is first read (or at the drain): gradients averaged over dp,
  summed over tied copies on other ranks (2BW only), clipped (``max_grad_norm``, 2BW only: the
  global norm of this update's gradient over every stage and rank, runtime/state/clip.py), learning rate
  scaled (PipeMare), the user's optimizer stepped, PipeMare's ``delta`` advanced.
- Schedulers: ``train_step`` snapshots ``program.optimizer.param_groups``' settings (lr, weight
  decay, ...) for the batch it feeds, and every update of that batch's microbatches steps with
  them, whenever its stage runs it (an update of batch ``b`` may run during the call that feeds
  ``b + 1``, after a scheduler moved on). So a scheduler stepped once per ``train_step`` gives
  each batch's updates one learning rate, as a synchronous step would, and the numbers still do not
  depend on how the stream is cut into calls (docs/training_loop.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.distributed as dist
from torch.func import functional_call

from autopar.errors import PlanError
from autopar.ir.dynamic_shapes import batch_sizes
from autopar.ops.flight_record import ACTION
from autopar.ops.p2p import P2PNode
from autopar.runtime.state.clip import clip_program_gradients
from autopar.runtime.execution.executor import ActionEvent, weigh_loss
from autopar.runtime.state.grad_sync import average_gradients, sum_shared_gradients
from autopar.runtime.state.param_groups import settings_of
from autopar.runtime.execution.program_surface import ProgramSurface
from autopar.runtime.schedules.action import Action, ActionKind
from autopar.runtime.schedules.asynchronous import stream_segment
from autopar.runtime.execution.step_report import group_lrs
from autopar.runtime.execution.weight_versions import WeightVersions, corrected_weights, update_velocity

__all__ = ["AsyncProgram"]

log = logging.getLogger(__name__)


def _snapshot(groups: list[dict]) -> list[dict]:
    """Each group's settings as they are now (a tensor learning rate copied: schedulers set it in place)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in settings_of(g).items()} for g in groups]


class _Proxy:
    """Stands in for the p2p channel of a stage: records received activations, or replays them."""

    def __init__(self, channel, microbatch: int, replay: dict | None = None):
        self.channel, self.microbatch, self.replay = channel, microbatch, replay
        self.received: dict[int, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        """The channel's device: receive nodes build their anchors on it."""
        return self.channel.device

    @property
    def sizes(self) -> dict:
        """The running microbatch's symbolic dims: send and recv nodes shape their edges by them."""
        return self.channel.sizes

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def action(self) -> str:
        return self.channel.action

    def send(self, tensor, *, stage, edge, microbatch, is_grad):
        if self.replay is None or is_grad:  # a recompute does not send its activations again
            self.channel.send(tensor, stage=stage, edge=edge, microbatch=microbatch, is_grad=is_grad)

    def expect_gradient(self, shape, dtype, *, stage, edge, microbatch, my_stage) -> None:
        """Nothing to note: this loop posts no receives ahead (runtime/execution/executor.py does)."""

    def recv(self, shape, dtype, *, stage, edge, microbatch, is_grad, my_stage):
        if is_grad:
            return self.channel.recv(shape, dtype, stage=stage, edge=edge, microbatch=microbatch,
                                     is_grad=True, my_stage=my_stage)
        if self.replay is not None:
            return self.replay[edge]
        self.received[edge] = self.channel.recv(shape, dtype, stage=stage, edge=edge, microbatch=microbatch,
                                                is_grad=False, my_stage=my_stage)
        return self.received[edge]


@contextlib.contextmanager
def _bound(stage, channel):
    """Point the stage's send/recv nodes at ``channel`` for the duration."""
    nodes = [m for m in stage.gm.modules() if isinstance(m, P2PNode)]
    before = [m.channel for m in nodes]
    for m in nodes:
        m.channel = channel
    try:
        yield
    finally:
        for m, c in zip(nodes, before):
            m.channel = c


def _roots(stage, out, scale: int):
    """What a backward starts from: the scaled loss, or the send tokens that carry a gradient."""
    if stage.is_last:
        loss = out[0] if isinstance(out, (tuple, list)) else out
        return [loss / scale], None
    tokens = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
    return tokens, [torch.ones_like(t) for t in tokens]


class AsyncProgram(ProgramSurface):
    """This rank's parts run as one endless stream (no drain between steps); see the module doc."""

    def __init__(self, **parts):
        """``parts``: as :class:`ProgramSurface` builds them. The Plan's ``run`` carries PipeMare's warm-up and
        correction decay, and ``max_grad_norm``: 2BW's update of each batch clipped by the global norm of its
        gradient, refused by the others (docs/schedules.md)."""
        super().__init__(**parts)
        rule, run = self.schedule.staleness, self.plan.run
        max_grad_norm = run.max_grad_norm
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        if rule.kind == "pipemare":
            rule = dataclasses.replace(rule, lr_warmup_updates=run.pipemare_lr_warmup_updates,
                                       correction_decay=run.pipemare_correction_decay)
        self.rule = rule
        self._check_supported()
        self.check_clipping(max_grad_norm, name=self.schedule.name)
        (self.stage,) = self.stages.values()
        self.versions = WeightVersions(self.named_params)
        index = {id(p): k for k, (_, p) in enumerate(self.named_params)}
        self._gm_params = [(name, index[id(p)]) for name, p in self.stage.gm.named_parameters()]
        self.tied = self._shared_params()
        self.delta = [torch.zeros_like(p) for p in self.versions.params] if rule.kind == "pipemare" else None
        self._settings: dict[int, list[dict]] = {}  # batch of the stream -> its groups' settings (lr, ...)
        self._cursor = (0, 0)  # next forward, next backward (global microbatch numbers)
        self._fed = 0  # microbatches fed so far
        self._inputs: dict[int, dict] = {}
        self._held: dict[int, tuple] = {}
        self._stashed: dict[int, int] = {}  # in-flight microbatch -> the version its autograd graph holds
        self.peak_versions = 1  # most weight versions alive at once (kept snapshots and stashed ones)

    def _check_supported(self) -> None:
        name, plan = self.schedule.name, self.plan
        problems = []
        if len(self.stages) != 1:
            problems.append(("one stage per rank", "drop num_virtual"))
        if plan.zero_stage > 1 or getattr(plan, "precision", "fp32") != "fp32" or self.mixed is not None:
            problems.append(("zero_stage 0 or 1 and fp32", "use zero_stage=1 and precision='fp32'"))
        if problems:
            raise PlanError(f"asynchronous schedule {name!r} needs " + "; ".join(p for p, _ in problems),
                            where=f"compile(schedule={name!r}), rank {self.info.rank}",
                            fix="; ".join(f for _, f in problems))
        self.check_tied(plan, stage_to_rank=self.schedule.stage_to_rank, name=name)

    @staticmethod
    def check_clipping(max_grad_norm: float | None, *, name: str) -> None:
        """Clipping by the global norm is exact under 2BW only (docs/schedules.md, "Gradient clipping")."""
        if max_grad_norm is None or name == "pipedream_2bw":
            return
        raise PlanError(
            f"max_grad_norm cannot be applied exactly under {name!r}: its stages apply update k at different "
            f"points of the stream (the last stage right after its own backward of microbatch k, stage 0 only "
            f"after p - 1 more forwards), so the norm of update k over every stage would hold the last stage "
            f"until stage 0 has finished that backward, across the step's loss exchange: the ranks would wait "
            f"on each other for ever",
            where=f"compile(schedule={name!r}, max_grad_norm={max_grad_norm})",
            fix="use schedule='pipedream_2bw' (every stage applies a batch's update at the same point, and "
                "clips it), a synchronous schedule, or max_grad_norm=None")

    @staticmethod
    def check_tied(plan, *, stage_to_rank, name: str) -> None:
        """PipeDream and PipeMare update each stage on its own clock: no weight may live on two ranks."""
        if name == "pipedream_2bw":
            return
        for weight, stages in plan.shared_params.items():
            if len({stage_to_rank[s] for s in stages}) > 1:
                raise PlanError(
                    f"asynchronous schedule {name!r} needs no weight shared by stages on different ranks, but "
                    f"{weight!r} is on stages {list(stages)}: each stage updates it on its own clock",
                    where=f"compile(schedule={name!r})",
                    fix="use 'pipedream_2bw' (it sums the copies' gradients once per batch), a synchronous "
                        "schedule, or a model without tied weights (e.g. llama_tiny)")

    @torch.no_grad()
    def __call__(self, *inputs):
        """Forward only on the live weights: the model's output for this rank's batch, on every rank."""
        return self._forward_only(inputs)

    # -- the stream ------------------------------------------------------------------------
    def train_step(self, *inputs, target: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one batch (tensors, or the dict batch compiled on) into the running pipeline; returns its
        global mean loss (every rank). The model's own loss counts label tokens per update (docs/hf.md)."""
        if not self.captured.has_loss:
            raise PlanError("this program was compiled without a loss", where="train_step",
                            fix="pass loss_fn= (and example_target=) to autopar.compile, or a dict batch with labels")
        self._flight_step()
        start = time.perf_counter()
        tensors = self._batch(inputs, target, "train_step")
        batches = self._microbatches(tensors)
        self._count_items(batches, per_update=self.rule.updates_every)
        self.index_guard.agree(self.index_guard.inspect(batches), guard=self.comm_guard, rank=self.info.rank,
                               step=f"training step {self.step_count + 1}")  # runtime/execution/index_guard.py
        self.comm_log.reset()  # this step's dp collectives (its updates' ZeRO-1 broadcasts), as a synchronous step
        first = self._fed
        # the settings (lr, ...) this batch's updates step with, whenever each stage runs them
        settings = self._settings[first // len(batches)] = _snapshot(self.optimizer.param_groups)
        for k, batch in enumerate(batches):
            self._inputs[first + k] = batch
        self._fed += len(batches)
        results = self._run(end=self._fed - 1)
        self.step_count += 1
        # a scheduler stepped after this call counts it as the optimizer's step (torch warns otherwise)
        self.optimizer._opt_called = True
        loss = self._batch_loss([results[i] for i in sorted(results)])
        self._report(loss, lrs=group_lrs(settings), grad_norm=None, inputs=tensors, start=start)
        return loss

    def flush(self) -> None:
        """Finish every pending backward and apply every pending update (the pipeline drains)."""
        self._run(end=None)
        self.versions.apply_pending(self._update)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights after every fed batch's update (flushes first); collective, like the base class."""
        self.flush()
        return super().full_state_dict()

    def save_checkpoint(self, root: str, *, extra=None) -> str:
        """Flush, then save as the base class does."""
        self.flush()
        return super().save_checkpoint(root, extra=extra)

    def load_checkpoint(self, path: str, *, extra=None) -> int:
        """Load as the base class does; the stream restarts from the loaded weights (version 0)."""
        step = super().load_checkpoint(path, extra=extra)
        self._restart()
        return step

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Set the weights; the stream restarts from them (version 0)."""
        super().load_full_state_dict(state_dict)
        self._restart()

    def _restart(self) -> None:
        if self._held:
            raise PlanError("cannot load weights into a pipeline with microbatches in flight",
                            where="asynchronous program", fix="call program.flush() first")
        self.versions = WeightVersions(self.named_params)
        self._cursor, self._fed, self._inputs, self._stashed, self._settings = (0, 0), 0, {}, {}, {}
        if self.delta is not None:
            self.delta = [torch.zeros_like(p) for p in self.versions.params]

    def _run(self, *, end: int | None) -> dict[int, torch.Tensor]:
        """Run this rank's segment of the stream up to the forward of microbatch ``end`` (None: drain)."""
        pp = self.info.coords["pp"]
        actions, self._cursor = stream_segment(rank=pp, num_ranks=self.plan.mesh.pp, next_forward=self._cursor[0],
                                               next_backward=self._cursor[1], end=end)
        self.events, results = [], {}
        start = time.perf_counter()
        for action in actions:
            self.channel.action, self.channel.microbatch = str(action), action.microbatch
            entry = None if self.flight is None else self.flight.begin(ACTION, str(action), stage=action.stage,
                                                                       microbatch=action.microbatch)
            t0, waited = time.perf_counter(), self.channel.wait_s
            if action.kind is ActionKind.F:
                loss = self._forward(action)
                if loss is not None:
                    results[action.microbatch] = loss
            else:
                self._backward(action)
            # a weight copy goes with the last backward that read it (WeightVersions.done)
            self.peak_versions = max(self.peak_versions, len(self.versions.held | set(self._stashed.values())))
            if entry is not None:
                self.flight.end(entry)
            self.events.append(ActionEvent.timed(str(action), t0, time.perf_counter(), origin=start,
                                                 wait_s=self.channel.wait_s - waited))
        # a send completes when its receiver takes it, maybe only in the next call: wait for those taken
        self.channel.flush() if end is None else self.channel.prune(self._taken)
        return results

    def _taken(self, stage: int, microbatch: int, is_grad: bool) -> bool:
        """Whether ``stage`` has received this rank's send of ``microbatch``, judged from what it sent since.

        In the 1F1B stream a stage with ``w`` warm-up forwards runs B(k) right after F(k + w): an activation
        it takes at F(i) precedes its B(j) for j >= i - w; a gradient it takes at B(i) precedes its F(j)
        for j > i + w. The newest of each this rank has received from ``stage`` says how far it got."""
        w = self.rule.delay(stage)
        if is_grad:
            return self.channel.heard.get((stage, False), -1) > microbatch + w
        return self.channel.heard.get((stage, True), -1) >= microbatch - w

    def _forward(self, action: Action):
        i, s = action.microbatch, self.stage.stage
        version = self.rule.forward_version(s, i)
        self.versions.apply_through(version, self._update)
        batch = self._inputs[i] if not self.rule.stashes else self._inputs.pop(i)
        args = tuple(batch[n] for n in self.stage.input_names)
        self.channel.sizes = batch_sizes(self.stage.dynamic, batch)
        if self.rule.stashes:
            # a copy only where this stage applies an update before the backward (after w more forwards)
            copy = self.rule.forward_version(s, i + self.rule.delay(s)) != version
            leaves = [t.requires_grad_() for t in self.versions.read(version, copy=copy, microbatch=i)]
            out = weigh_loss(self.stage, functional_call(self.stage.gm, self._by_gm_name(leaves), args), batch)
            self._held[i], self._stashed[i] = (out, leaves), version
        else:  # no stash: no autograd now; B recomputes from the inputs kept here
            assert self.versions.applied == version, "a forward without stashing reads the newest weights"
            proxy = _Proxy(self.channel, self.channel.microbatch)
            with _bound(self.stage, proxy), torch.no_grad():
                out = weigh_loss(self.stage, self.stage.gm(*args), batch)
            self._held[i] = (version, proxy.received)
        if self.stage.is_last:
            loss = out[0] if isinstance(out, (tuple, list)) else out
            return loss.detach()
        return None

    def _backward(self, action: Action) -> None:
        i, s = action.microbatch, self.stage.stage
        self.channel.post_backward(stage=s, microbatch=i)  # the receives its forward's sends noted
        if self.rule.stashes:
            out, leaves = self._held.pop(i)
            del self._stashed[i]
            roots, grads = _roots(self.stage, out, self.rule.updates_every)
            torch.autograd.backward(roots, grads)
            self.versions.done(i)
        else:
            version, received = self._held.pop(i)
            self.versions.apply_through(self.rule.backward_version(s, i), self._update)
            lag = self.rule.backward_version(s, i) - version
            leaves = [w.requires_grad_() for w in corrected_weights(self.versions.params, self.delta, lag)]
            batch = self._inputs.pop(i)
            args = tuple(batch[n] for n in self.stage.input_names)
            self.channel.sizes = batch_sizes(self.stage.dynamic, batch)
            with _bound(self.stage, _Proxy(self.channel, self.channel.microbatch, replay=received)):
                out = weigh_loss(self.stage, functional_call(self.stage.gm, self._by_gm_name(leaves), args), batch)
                roots, grads = _roots(self.stage, out, self.rule.updates_every)
                torch.autograd.backward(roots, grads)
        self.versions.accumulate(self.rule.update_of(i), [leaf.grad for leaf in leaves])

    def _by_gm_name(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensors[k] for name, k in self._gm_params}

    def _update(self, update: int, grads: list[torch.Tensor]) -> None:
        """Update ``update``: dp average, tied copies summed, lr scaled, optimizer step, PipeMare's delta."""
        params = self.versions.params
        for p, g in zip(params, grads):
            p.grad = g
        average_gradients(params, group=self.info.groups["dp"], size=self.plan.mesh.dp, guard=self.comm_guard)
        sum_shared_gradients(self.tied, rank=self.info.rank, group=self.info.groups["pp"], guard=self.comm_guard)
        if self.max_grad_norm is not None:  # 2BW: every rank applies update t at the start of batch t + 2
            self.last_grad_norm = clip_program_gradients(self, max_norm=self.max_grad_norm)
        batch = update * self.rule.updates_every // self.plan.pipeline.num_microbatches  # the batch it trains on
        scale = self.rule.lr_scale(self.stage.stage, update)
        settings = [{**g, "lr": g["lr"] * scale} if "lr" in g else g for g in self._settings[batch]]
        old = [p.detach().clone() for p in params] if self.delta is not None else None
        with self.optimizer.stepping(settings):
            self.optimizer.step()
        for earlier in [b for b in self._settings if b < batch]:  # updates run in order: no one reads these again
            del self._settings[earlier]
        if self.delta is not None:
            update_velocity(self.delta, old, params, decay=self.rule.correction_decay)
        for p in params:
            p.grad = None

    def _batch_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The batch's mean loss from the last stage, averaged over dp, on every rank."""
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.info.device)
        if self.plan.mesh.dp > 1:
            self.comm_guard.run("all_reduce", dist.all_reduce, loss, group=self.info.groups["dp"],
                                purpose="the batch's loss (mean over dp)")
            loss /= self.plan.mesh.dp
        if self.plan.mesh.pp > 1:
            self.comm_guard.run("broadcast", dist.broadcast, loss, src=self.last_stage_rank,
                                group=self.info.groups["pp"], purpose="the batch's loss (from the last stage)")
        return loss
