"""Dynamic load balancing: re-split a running pipeline from the stage times measured while it trains.

A split chosen from FLOPs can be wrong at run time: a stage whose ops are memory-bound, a slower
device, a neighbour job on the same cores. :class:`LoadBalancer` watches ``program.events`` (the
executor's timed actions) and, when asked, proposes the stage boundaries that balance the
*measured* times; on request it applies them at a step boundary:

1. :meth:`LoadBalancer.observe` after each ``train_step`` adds up this rank's busy seconds per
   stage (each action's duration less the time it waited for a peer; local, no communication).
2. :meth:`LoadBalancer.propose` (collective) gathers every stage's mean busy time and fits it
   as ``fixed + beta·cost``: ``cost`` is the stage's predicted time (FLOPs, bytes and ops of its
   chunks on the cluster's device, as the planner's cost model counts them, divided by the device's
   known relative speed), ``fixed`` what every stage pays whatever it holds (per-action work).
   A stage whose own ``beta`` departs from the common one by more than ``tolerance`` runs on a
   slower (or faster) rank; within it, the difference is noise. (Two pp ranks fit ``fixed`` and
   ``beta`` exactly, so they cannot also reveal a slow rank: only the cluster's device speeds count.)
   :func:`~autopar.planner.stage_cuts.weighted_cuts` then places the boundaries so that cost / speed
   is balanced; the proposal says how much faster the slowest stage should get.
3. :meth:`LoadBalancer.apply` (collective) compiles the program again with the new
   ``Plan.pipeline.stage_starts`` and moves everything over through a resharding checkpoint
   (:mod:`autopar.runtime.checkpoints.checkpoint`): weights, buffers, optimizer state (by parameter name, so
   SGD momentum and Adam moments follow their weight to its new stage) and the step counter.
   Nothing is lost: training continues as if the split had been the new one from the start.

Example (every rank)::

    balancer = LoadBalancer(program)
    for step in range(20):
        program.train_step(x, target=y)
        balancer.observe()
    proposal = balancer.propose()
    if proposal.gain > 0.05:
        program = balancer.apply(proposal)
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch.distributed as dist

from autopar.errors import PlanError
from autopar.ir.meta_keys import COST, get_meta
from autopar.lowering import user_name
from autopar.passes.pipeline.partition import _allowed_starts, pipeline_segments
from autopar.planner.stage_cuts import stage_time, weighted_cuts
from autopar.runtime.schedules.action import Action

__all__ = ["Proposal", "LoadBalancer", "stage_busy_times"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proposal:
    """New stage starts (as ``Plan.pipeline.stage_starts`` names them) and what they should gain."""

    stage_starts: tuple[str, ...]
    current: tuple[str, ...]
    stage_seconds: tuple[float, ...]  # measured busy seconds per step, by stage
    speeds: tuple[float, ...]  # cost units per second, by stage (after snapping)
    gain: float  # predicted relative drop of the slowest stage's time (0 when unchanged)

    @property
    def changed(self) -> bool:
        return self.stage_starts != self.current


def stage_busy_times(events) -> dict[int, float]:
    """{stage: seconds} of one step's events: each action's duration less its wait for a peer."""
    out: dict[int, float] = {}
    for event in events:
        action = Action.parse(event[0])
        busy = max(0.0, (event[2] - event[1]) - getattr(event, "wait_s", 0.0))
        out[action.stage] = out.get(action.stage, 0.0) + busy
    return out


def _chunks(program, device):
    """Predicted seconds (up to one scale) and unit names of each chunk of the program's whole-model graph.

    A chunk costs ``flops/R + bytes/BW + ops·o`` on ``device``: FLOPs alone misjudge small or
    memory-bound stages, whose time is mostly per-op overhead.
    """
    segments = pipeline_segments(program.captured.gm)
    allowed = _allowed_starts(segments)
    bounds = [0] + allowed + [len(segments)]
    rate = device.matmul_rate(program.plan.precision)
    costs = []
    for i in range(len(bounds) - 1):
        nodes = [n for seg in segments[bounds[i]:bounds[i + 1]] for n in seg.nodes]
        flops = sum(c.flops for n in nodes if (c := get_meta(n, COST)) is not None)
        written = sum(c.activation_bytes for n in nodes if (c := get_meta(n, COST)) is not None)
        costs.append(flops / rate + written / device.memory_bandwidth + len(nodes) * device.op_overhead_s)
    units = [user_name(segments[b].unit) for b in bounds[:-1]]
    return costs, units


class LoadBalancer:
    """Measures a program's stages while it trains; proposes and applies a better split."""

    def __init__(self, program, *, cluster=None, tolerance: float = 0.25, warmup: int = 1):
        from autopar.planner.cluster import get_cluster, local_cluster

        self.program = program
        self.tolerance = tolerance
        report = getattr(program, "planner", None)
        self.cluster = get_cluster(cluster) if cluster is not None else (
            report.cluster if report is not None else local_cluster())
        self.totals: dict[int, float] = {}
        self.steps = 0
        self.warmup = warmup  # first steps not counted (first-call costs)

    def observe(self) -> None:
        """Add the last ``train_step``'s per-stage busy times (call after every step; local)."""
        if self.warmup > 0:
            self.warmup -= 1
            return
        for stage, seconds in stage_busy_times(self.program.events).items():
            self.totals[stage] = self.totals.get(stage, 0.0) + seconds
        self.steps += 1

    def _gathered(self) -> dict[int, float]:
        mine = {s: t / max(1, self.steps) for s, t in self.totals.items()}
        if not (dist.is_available() and dist.is_initialized()):
            return mine
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        merged: dict[int, list[float]] = {}
        for part in every:
            for s, t in part.items():
                merged.setdefault(s, []).append(t)
        return {s: max(ts) for s, ts in merged.items()}  # the slowest replica of a stage sets the pace

    def propose(self) -> Proposal:
        """The split that balances the measured stage times (collective: every rank calls it)."""
        if self.steps == 0:
            raise PlanError("no training step observed yet", where="LoadBalancer.propose",
                            fix="call balancer.observe() after each program.train_step(...)")
        plan = self.program.plan
        num_stages = plan.mesh.pp * plan.pipeline.num_virtual
        times = self._gathered()
        costs, units = _chunks(self.program, self.cluster.device)
        current = tuple(plan.pipeline.stage_starts)
        cuts = [units.index(name) for name in current] if current else []
        bounds = [0, *cuts, len(costs)]
        prior = self._prior_speeds(num_stages)
        stage_cost = [sum(costs[bounds[s]:bounds[s + 1]]) / prior[s] for s in range(num_stages)]
        seconds = tuple(times.get(s, 0.0) for s in range(num_stages))
        fixed, beta = _fit(stage_cost, seconds)
        if beta <= 0:
            return Proposal(stage_starts=current, current=current, stage_seconds=seconds, speeds=tuple(prior),
                            gain=0.0)
        betas = [(t - fixed) / c if t > fixed and c > 0 else beta for c, t in zip(stage_cost, seconds)]
        # two ranks fit (fixed, beta) exactly: their times cannot also tell a slow rank apart
        betas = _snap(betas, self.tolerance) if plan.mesh.pp > 2 else [beta] * num_stages
        owner = self.program.schedule.stage_to_rank
        per_rank: dict[int, list[float]] = {}
        for s, b in enumerate(betas):  # a rank's stages share its device: one speed per rank
            per_rank.setdefault(owner[s], []).append(b)
        speeds = [prior[s] * beta / (sum(per_rank[owner[s]]) / len(per_rank[owner[s]])) for s in range(num_stages)]
        new_cuts = weighted_cuts(costs, num_stages, speeds=speeds) if num_stages > 1 else []
        before = fixed + beta * stage_time(costs, cuts, speeds)
        after = fixed + beta * stage_time(costs, new_cuts, speeds)
        new = tuple(units[c] for c in new_cuts)
        gain = max(0.0, 1 - after / before) if new != current and before > 0 else 0.0
        return Proposal(stage_starts=new if gain > 0 else current, current=current, stage_seconds=seconds,
                        speeds=tuple(speeds), gain=gain)

    def _prior_speeds(self, num_stages: int) -> list[float]:
        """Each stage's device speed relative to the cluster's base device (1 on a homogeneous cluster)."""
        if not self.cluster.groups:
            return [1.0] * num_stages
        plan = self.program.plan
        base = self.cluster.device.matmul_rate(plan.precision)
        owner = self.program.schedule.stage_to_rank
        rank_speed = []
        for q in range(plan.mesh.pp):
            ranks = [(d * plan.mesh.pp + q) * plan.mesh.tp + t for d in range(plan.mesh.dp) for t in range(plan.mesh.tp)]
            rank_speed.append(min(self.cluster.device_of(r).matmul_rate(plan.precision) for r in ranks) / base)
        return [rank_speed[owner[s]] for s in range(num_stages)]

    def apply(self, proposal: Proposal, *, directory: str | None = None):
        """Recompile with ``proposal``'s split and move all state over (collective); returns the new program.

        ``directory``: where the handover checkpoint is written (every rank must see it; default: a
        temporary folder on this machine, fine for single-host jobs).
        """
        program = self.program
        if not proposal.changed:
            return program
        args = getattr(program, "compile_args", None)
        if args is None:
            raise PlanError("this program does not know how it was compiled", where="LoadBalancer.apply",
                            fix="compile it with autopar.compile (which records its arguments)")
        import autopar

        plan = program.plan
        new_plan = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(
            update={"stage_starts": proposal.stage_starts})})
        folder = _shared_folder(directory)
        try:
            program.save_checkpoint(folder)
            new = autopar.compile(args["model"], args["mesh"], example_inputs=args["example_inputs"],
                                  loss_fn=args["loss_fn"], example_target=args["example_target"],
                                  optimizer=args["optimizer"], plan=new_plan, **args["options"])
            new.load_checkpoint(folder)
        finally:
            _remove(folder, owned=directory is None)
        log.info("re-split the pipeline: %s -> %s (slowest stage -%.0f%% predicted)",
                 list(proposal.current), list(proposal.stage_starts), 100 * proposal.gain)
        self.program, self.totals, self.steps, self.warmup = new, {}, 0, 1
        return new


def _fit(costs: list[float], seconds: tuple[float, ...]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + beta·cost`` over the stages (fixed, beta >= 0).

    ``fixed`` is what a stage costs whatever it holds (the executor's per-action work, the
    autograd engine's start); ``beta`` converts predicted cost into this machine's seconds.
    """
    n = len(costs)
    mean_c, mean_t = sum(costs) / n, sum(seconds) / n
    var = sum((c - mean_c) ** 2 for c in costs)
    beta = sum((c - mean_c) * (t - mean_t) for c, t in zip(costs, seconds)) / var if var > 0 else 0.0
    fixed = mean_t - beta * mean_c
    if beta <= 0:  # the stages' costs do not show in their times: nothing to balance
        return mean_t, 0.0
    if fixed < 0:  # no fixed part the data supports: time proportional to cost
        fixed, beta = 0.0, sum(seconds) / max(sum(costs), 1e-300)
    return fixed, beta


def _snap(values: list[float], tolerance: float) -> list[float]:
    """Values within ``tolerance`` of their median become the median (noise is not a slow device)."""
    ordered = sorted(values)
    median = ordered[len(ordered) // 2]
    return [median if median > 0 and abs(v / median - 1) <= tolerance else v for v in values]


def _shared_folder(directory: str | None) -> str:
    if directory is not None:
        return directory
    if not (dist.is_available() and dist.is_initialized()):
        return tempfile.mkdtemp(prefix="autopar-rebalance-")
    folder = [tempfile.mkdtemp(prefix="autopar-rebalance-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def _remove(folder: str, *, owned: bool) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if owned and (not dist.is_initialized() or dist.get_rank() == 0) and os.path.isdir(folder):
        shutil.rmtree(folder, ignore_errors=True)
