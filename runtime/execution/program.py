"""One rank's compiled program: its stage graphs, schedule, process groups and optimizer.

``train_step`` runs the schedule over this rank's data-parallel batch, sums tied-weight gradients
across stages, averages gradients over dp, steps the (ZeRO-sharded) optimizer and returns the
global mean loss on every rank. Calling the program (no loss) runs forward only.
Every collective it issues waits at most ``p2p_timeout_s`` (:mod:`autopar.ops.comm_guard`).
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, PlanError
from autopar.ir.graph_names import user_name
from autopar.runtime.state.clip import clip_program_gradients, counted_parameters, squares_of
from autopar.runtime.execution.executor import run_actions
from autopar.runtime.state.grad_sync import GradientSync
from autopar.runtime.execution.numerics import check_finite
from autopar.runtime.execution.program_surface import ProgramSurface
from autopar.runtime.execution.step_report import group_lrs
from autopar.runtime.diagnostics.stragglers import StragglerCheck
from autopar.runtime.state.tp_grad_sync import sum_partial_gradients

__all__ = ["RankProgram"]

log = logging.getLogger(__name__)


class RankProgram(ProgramSurface):
    """This rank's share of the parallel program: the synchronous schedules' step over its parts."""

    def __init__(self, **parts):
        """``parts``: what :class:`~autopar.runtime.execution.program_surface.ProgramSurface` builds the parts from
        (clipping: the Plan's ``run.max_grad_norm``)."""
        super().__init__(**parts)
        p = self.parts
        self.max_grad_norm, self.last_grad_norm = self.plan.run.max_grad_norm, None
        partial = {user_name(t) for t in p.tp_partial_grads}  # sequence parallelism: summed over tp
        self.tp_partial_params = [prm for n, prm in self.named_params if n in partial]
        self.grad_sync = GradientSync(self.named_params, ctx=self.ctx, shared=self._shared_params(), plan=self.plan,
                                      owners=self.optimizer.owner_of(), uses=p.uses,
                                      current_action=self._doing, zero3_runtimes=p.zero3,
                                      expert_owners=self.optimizer.expert_owner_of())
        self.loss_ranks = p.loss_ranks  # ranks whose stages compute the loss (two for Chimera: one per replica)
        self.stragglers: list = []  # the last step's stragglers (runtime/diagnostics/stragglers.py)
        self._straggler_check = None
        if self.flight is not None and dist.is_initialized() and dist.get_world_size() > 1:
            self._straggler_check = StragglerCheck(
                rank=self.info.rank, world=dist.get_world_size(), pp=self.info.coords["pp"],
                action_names=[[str(a) for a in row] for row in self.schedule.actions], flight=self.flight,
                device=self.info.device)
        self.norm_counted = counted_parameters(self)  # its share of the global gradient norm (runtime/state/clip.py)

    def _doing(self) -> str:
        """The schedule's action running now, or the step's phase outside the schedule (a bucket's launch label)."""
        return self.channel.action if self.phase == "schedule" else self.phase

    # -- running ---------------------------------------------------------------------------
    def _sync_gradients(self) -> None:
        """Wait for the dp reductions started during backward; tied weights across stages (grad_sync.py)."""
        self.grad_sync.finish()

    def train_step(self, *inputs, target: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step on this rank's dp batch; returns the global mean loss (every rank).

        ``inputs``: the tensors, or the one dict batch the program was compiled on; ``target`` when
        it was compiled with a ``loss_fn`` (a dict batch with ``labels`` and no loss_fn needs none).
        """
        if not self.captured.has_loss:
            raise PlanError("this program was compiled without a loss", where="train_step",
                            fix="pass loss_fn= (and example_target=) to autopar.compile, or a dict batch with labels")
        self._flight_step()
        start = time.perf_counter()
        tensors = self._batch(inputs, target, "train_step")
        batches, stages = self._step_batches(tensors)
        schedule = self.batching.schedule_for(len(batches))
        index_problem = self.index_guard.inspect(batches)  # reported with the non-finite check, on every rank
        self.optimizer.zero_grad()
        if self._straggler_check is not None:  # (its warnings name the actions of this step's schedule)
            self._straggler_check.action_names = [[str(a) for a in row] for row in schedule.actions]
            self._straggler_check.begin()
        self.events = []
        self.comm_log.reset()
        self.grad_sync.begin(len(batches))
        self.phase = "schedule"
        results = run_actions(schedule.actions[self.info.coords["pp"]], stages=stages,
                              microbatches=batches, channel=self.channel, train=True, events=self.events,
                              full_backward=schedule.full_backward)
        if self.mixed is not None:
            self.mixed.collect()
        self.phase = "gradient sync after the schedule"
        self._sync_gradients()
        sum_partial_gradients(self.tp_partial_params, group=self.info.groups["tp"], guard=self.comm_guard)
        self.phase = "non-finite check and loss reduction"
        # runtime/execution/numerics.py: a NaN/inf, or a bad index any rank found, stops the step on every rank;
        # the step's loss and the squared gradient norm (runtime/state/clip.py) are summed over the world on the
        # same all-reduce; each rank's action figures ride on it too, for the straggler check
        # (runtime/diagnostics/stragglers.py)
        check = self._straggler_check
        squares = squares_of(self.norm_counted, device=self.info.device)
        riders = torch.cat([self._loss_share(results, num_microbatches=len(batches)), squares.float().reshape(1)])
        if check is not None:
            riders = torch.cat([riders, check.riders(self.events)])
        summed = check_finite(self, results, index_problem=index_problem, riders=riders)
        loss_total, squares = summed[0], summed[1]
        if check is not None:
            self.stragglers = check.judge(summed[2:], step=self.step_count + 1)
        norm = squares.clamp(min=0).sqrt()
        if self.max_grad_norm is not None:  # the global norm over every shard and axis, scaled to max_grad_norm
            self.phase = "gradient clipping"
            self.last_grad_norm = clip_program_gradients(self, max_norm=self.max_grad_norm, norm=norm)
        self.phase = "optimizer step"
        lrs = group_lrs(self.optimizer.param_groups)  # what this step uses (a scheduler changes them after)
        with self.optimizer.stepping():
            self.optimizer.step()  # then publishes the masters into the bf16 copies (mixed precision)
        self.step_count += 1
        loss = loss_total / (self.plan.pipeline.num_microbatches * self.plan.dims.dcp)  # (dp x cp shares)
        self._report(loss, lrs=lrs, grad_norm=float(norm), inputs=tensors, start=start)
        return loss

    def _step_batches(self, tensors: tuple) -> tuple[list[dict], list[dict]]:
        """(microbatches, the stage graphs of each) of this step, agreed over dp (runtime/execution/step_batches.py):
        a batch any dp rank refuses raises autopar's error on every rank before anything runs."""
        self.phase = "cutting the batch"
        batches = stages = problem = None
        try:
            batches, stages = self.batching.cut(tensors)
        except AutoparError as exc:  # raised on every rank after the agreement
            problem = exc
        self.phase = "agreeing on the step's rows and tokens"  # (one all-reduce over dp)
        self.batching.agree(batches, problem, train=True)
        return batches, stages

    def _loss_share(self, results: dict, *, num_microbatches: int) -> torch.Tensor:
        """This rank's part of the step's loss sum (1 element, fp32): the sum of its last-stage
        microbatch losses on tp rank 0, else 0, scaled by the Plan's microbatches over this step's
        (1 unless a partial batch made fewer). Summed over the world, then divided by the Plan's
        microbatches and dp ranks, it is the mean over each rank's microbatches and dp on every rank
        (each microbatch's loss already carries its token or row weight: runtime/execution/item_count.py,
        runtime/execution/batch_agreement.py); Chimera's two replicas each hold the losses of their own microbatches."""
        if not results or self.info.coords["tp"] != 0:
            return torch.zeros(1, device=self.info.device)
        losses = [results[i][0] if isinstance(results[i], (tuple, list)) else results[i] for i in sorted(results)]
        total = torch.stack(losses).float().sum().reshape(1)
        count = self.plan.pipeline.num_microbatches
        return total if num_microbatches == count else total * (count / num_microbatches)

    @torch.no_grad()
    def __call__(self, *inputs):
        """Forward only (no activations kept): the model's output for this rank's batch, on every rank."""
        return self._forward_only(inputs)
