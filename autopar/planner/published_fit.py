"""The GPU presets held to published runs: each run's estimate beside its measured step time, and the fit.

No GPU was used to make the GPU presets (:mod:`autopar.planner.cluster`). For every row of the table of
published runs (:mod:`autopar.planner.published`) the planner profiles the run's model (meta device,
identical blocks captured once), pins the run's own configuration (tp, pp, dp, microbatches, schedule,
ZeRO stage, recomputation; where the source does not say how many stages per rank an interleaved
schedule ran, the fastest that gives every stage as many blocks) and simulates its step
(:func:`published_estimate`), and lets the planner choose freely on the same GPUs and batch
(:func:`evaluate`, ``choose=True``).

What the cost model cannot derive from first principles is fitted on the rows not ``held_out``
(:func:`fit`): the share of peak that large matrix products reach (``Device.efficiency``), the time each
product costs beyond its FLOPs (``Device.gemm_overhead_s``: small products reach less), the memory
bandwidth memory-bound ops see, the bus bandwidths of the links inside and between nodes, and a fixed
time per step (``Cluster.step_overhead_s``). The fit minimises the squared log errors of the step times
(Levenberg-Marquardt on finite differences, each figure in log space, held near its first-principles
value by a weak prior so that a figure the rows cannot tell apart stays put). The held-out rows are
reported apart. ``bench/bench_published.py`` prints the table and keeps it in docs/planner.md.
"""
from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, replace

import torch

from autopar.errors import PlanError
from autopar.planner.cluster import Cluster, get_cluster
from autopar.planner.cost_model import Estimate
from autopar.planner.profile import ModelProfile, profile_model
from autopar.planner.published import PublishedRun
from autopar.planner.candidates import SearchSpace, structures
from autopar.planner.search import _Frontier, constraint, search
from autopar.runtime.schedules.registry import default_stages_per_rank

__all__ = ["PRESET_OF", "Figures", "Profiles", "RowResult", "run_cluster", "pinned_space", "evaluate_space",
           "published_estimate", "evaluate", "fit", "summarize"]

log = logging.getLogger(__name__)

PRESET_OF = {"a100-80g": "a100-80g-8x", "a100-40g": "a100-40g-8x", "h100-80g": "h100-80g-8x"}


def run_cluster(run: PublishedRun, *, clusters: dict | None = None) -> Cluster:
    """The run's GPUs: the preset of its GPU kind (or ``clusters[run.gpu]``), resized to its GPUs."""
    base = (clusters or {}).get(run.gpu) or get_cluster(PRESET_OF[run.gpu])
    if base.devices_per_node != run.devices_per_node:
        raise PlanError(f"run {run.id} has nodes of {run.devices_per_node} GPUs, the cluster {base.devices_per_node}",
                        where=f"published run {run.id}", fix="describe the run's nodes in its cluster")
    return base.for_world(run.gpus)


class Profiles:
    """Model profiles of the runs, one per model shape (the global batch is only a field of it)."""

    def __init__(self, *, tp_degrees: tuple[int, ...] = (1, 2, 4, 8)):
        self.tp_degrees, self.cache = tp_degrees, {}

    def __call__(self, run: PublishedRun) -> ModelProfile:
        if run.model not in self.cache:
            from autopar.models import lm_loss
            from autopar.options import CompileOptions
            model = run.model.build()
            tokens = torch.empty((run.global_batch, run.model.seq), dtype=torch.long, device="meta")
            self.cache[run.model] = profile_model(model, example_inputs=(tokens,), loss_fn=lm_loss,
                                                  example_target=tokens, tp_degrees=self.tp_degrees,
                                                  options=CompileOptions(precision="bf16"))
        return replace(self.cache[run.model], global_batch=run.global_batch)


def pinned_space(run: PublishedRun) -> SearchSpace:
    """The run's own configuration as a search space (only the stages per rank left open when unpublished)."""
    return SearchSpace(dp=(run.dp,), pp=(run.pp,), tp=(run.tp,), num_microbatches=(run.num_microbatches,),
                       schedules=((run.schedule, default_stages_per_rank(run.schedule)),),
                       virtual=(run.virtual,) if run.virtual else None, zero_stages=(run.zero,),
                       recompute=(run.recompute,), exact_top=1)


def evaluate_space(profile: ModelProfile, cluster: Cluster, *, world: int, space: SearchSpace,
                   optimizer: str = "adam") -> list[Estimate]:
    """Every candidate of ``space`` simulated, whether it fits or not (for a space pinned to a few candidates:
    a published configuration, :mod:`autopar.planner.published_fit`); stage cuts as the search places them."""
    frontier = _Frontier(profile, cluster, space, optimizer)
    out = []
    for s in structures(world, profile, cluster, space, frontier.rejected):
        for zero in (space.zero_stages if s.dp > 1 else (0,)):
            for rc in space.recompute:
                c = replace(s, zero_stage=zero, recompute=rc)
                if constraint(c) is None:
                    out.append(frontier.simulate(frontier.evaluate(c)))
    return out


def published_estimate(run: PublishedRun, profile: ModelProfile, cluster: Cluster) -> Estimate:
    """The run's own configuration, simulated (whether or not the memory calculator says it fits)."""
    found = evaluate_space(profile, cluster, world=run.gpus, space=pinned_space(run))
    if not found:
        raise PlanError(f"the configuration of run {run.id} is outside the planner's space", where=f"run {run.id}",
                        fix="check its mesh, microbatches and schedule against autopar.planner.search")
    return min(found, key=lambda e: e.step_time)


@dataclass(frozen=True)
class RowResult:
    """One run: its own configuration's estimate, and the planner's free choice on the same GPUs."""

    run: PublishedRun
    estimate: Estimate
    choice: Estimate | None = None

    @property
    def error(self) -> float:
        """Estimate over measured, less 1 (+0.10: the estimate is 10% slower than the run)."""
        return self.estimate.step_time / self.run.step_seconds - 1


def evaluate(runs, *, profiles: Profiles | None = None, clusters: dict | None = None, figures: "Figures | None" = None,
             choose: bool = True) -> list[RowResult]:
    """Each run's estimate (and, ``choose``, the planner's choice with nothing pinned), in table order; with
    ``figures``, each run on its GPUs' cluster with those figures applied for the run's framework."""
    profiles = profiles or Profiles()
    out = []
    for run in runs:
        profile, cluster = profiles(run), run_cluster(run, clusters=clusters)
        if figures is not None:  # the run's own framework's figures
            cluster = figures.apply(cluster, run.framework)
        else:  # the preset, with the fitted factor of the run's framework
            factor = FRAMEWORK_EFFICIENCY.get(run.framework, 1.0)
            cluster = cluster.model_copy(update={"device": cluster.device.model_copy(
                update={"efficiency": cluster.device.efficiency * factor})})
        estimate = published_estimate(run, profile, cluster)
        choice = search(profile, cluster, world=run.gpus, space=SearchSpace(exact_top=1)).best if choose else None
        out.append(RowResult(run, estimate, choice))
        log.info("%s: measured %.3g s, estimated %.3g s (%+.1f%%)", run.id, run.step_seconds, estimate.step_time,
                 100 * out[-1].error)
    return out


REFERENCE = "megatron-lm"  # the framework whose figures the presets carry
FIGURES = ("efficiency", "gemm_overhead_s", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth",
           "step_overhead_s")
# the efficiency a framework's runs reached against Megatron-LM's on the same GPUs (fitted with the presets)
FRAMEWORK_EFFICIENCY = {REFERENCE: 1.0, "megatron-deepspeed": 0.846}  # (fit), with the A100 presets
START_GEMM_OVERHEAD_S = 1e-5  # where the fit starts a figure the preset leaves at 0 (its prior's centre)
START_STEP_OVERHEAD_S = 0.05


@dataclass(frozen=True)
class Figures:
    """What the fit sets on a GPU preset (each figure is what the cost model reads, not a share of it), and
    for each other framework the factor on ``efficiency`` its runs reached against the reference's."""

    efficiency: float
    gemm_overhead_s: float
    memory_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    step_overhead_s: float
    frameworks: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, cluster: Cluster, frameworks=()) -> "Figures":
        d = cluster.device
        return cls(d.efficiency, d.gemm_overhead_s, d.memory_bandwidth, cluster.intra.bandwidth,
                   cluster.inter.bandwidth, cluster.step_overhead_s, tuple((f, 1.0) for f in frameworks))

    def apply(self, cluster: Cluster, framework: str = REFERENCE) -> Cluster:
        """``cluster`` with these figures (a run of ``framework``: its factor on the efficiency)."""
        factor = dict(self.frameworks).get(framework, 1.0)
        device = cluster.device.model_copy(update={"efficiency": min(1.0, self.efficiency * factor),
                                                   "gemm_overhead_s": self.gemm_overhead_s,
                                                   "memory_bandwidth": self.memory_bandwidth})
        return cluster.model_copy(update={
            "device": device, "intra": cluster.intra.model_copy(update={"bandwidth": self.intra_bandwidth}),
            "inter": cluster.inter.model_copy(update={"bandwidth": self.inter_bandwidth}),
            "step_overhead_s": self.step_overhead_s})

    def logs(self) -> torch.Tensor:
        values = [self.efficiency, self.gemm_overhead_s, self.memory_bandwidth, self.intra_bandwidth,
                  self.inter_bandwidth, self.step_overhead_s, *(f for _, f in self.frameworks)]
        return torch.tensor([math.log(max(v, 1e-9)) for v in values], dtype=torch.float64)

    def from_logs(self, x: torch.Tensor) -> "Figures":
        """Figures of the same frameworks from a vector of :meth:`logs`."""
        values = [math.exp(v) for v in x.tolist()]
        names = [f for f, _ in self.frameworks]
        return Figures(min(values[0], 1.0), *values[1:6], tuple(zip(names, values[6:])))


def _residuals(runs, profiles: Profiles, base: Cluster, figures: Figures) -> torch.Tensor:
    out = []
    for run in runs:
        cluster = figures.apply(base, run.framework)
        e = published_estimate(run, profiles(run), run_cluster(run, clusters={run.gpu: cluster}))
        out.append(math.log(e.step_time / run.step_seconds))
    return torch.tensor(out, dtype=torch.float64)


def fit(runs, *, base: Cluster, profiles: Profiles | None = None, iterations: int = 8, prior: float = 0.05,
        priors: dict | None = None, step: float = 0.02) -> tuple[Figures, list[float]]:
    """Figures of ``base`` (a preset) fitted to ``runs`` (all of one GPU kind): Levenberg-Marquardt on the log
    step-time errors, each figure in log space with a weak prior (``prior`` per unit of log; ``priors``:
    {figure name: weight} for others, a large weight holds a figure at its value) toward its value in
    ``base`` (a framework's factor toward 1). Returns the figures and the root-mean-square log error after
    each iteration."""
    profiles = profiles or Profiles()
    start = Figures.of(base, sorted({r.framework for r in runs} - {REFERENCE}))
    # figures the preset leaves at 0 start (and are held) near a plausible size: a launch per product, a
    # fraction of a second per step
    start = replace(start, gemm_overhead_s=start.gemm_overhead_s or START_GEMM_OVERHEAD_S,
                    step_overhead_s=start.step_overhead_s or START_STEP_OVERHEAD_S)
    runs = [_with_virtual(run, profiles, start.apply(base, run.framework)) for run in runs]
    x0 = start.logs()
    names = [*FIGURES, *(f for f, _ in start.frameworks)]
    weights = torch.tensor([(priors or {}).get(n, prior) for n in names], dtype=torch.float64)
    x, damping, history, eye = x0.clone(), 1e-2, [], torch.eye(len(x0), dtype=torch.float64)
    r = _residuals(runs, profiles, base, start.from_logs(x))
    for _ in range(iterations):
        jac = torch.stack([(_residuals(runs, profiles, base, start.from_logs(x + step * unit)) - r) / step
                           for unit in eye], dim=1)
        a, b = torch.cat([jac, torch.diag(weights)]), torch.cat([r, weights * (x - x0)])
        while damping <= 1e6:
            trial = x - torch.linalg.solve(a.T @ a + damping * eye, a.T @ b)
            r_trial = _residuals(runs, profiles, base, start.from_logs(trial))
            if _cost(r_trial, trial, x0, weights) < _cost(r, x, x0, weights):
                break
            damping *= 10
        if damping > 1e6:
            break
        x, r, damping = trial, r_trial, damping / 10
        history.append(float(r.pow(2).mean().sqrt()))
        log.info("fit: rms log error %.4f with %s", history[-1], start.from_logs(x))
    return start.from_logs(x), history


def _with_virtual(run: PublishedRun, profiles: Profiles, cluster: Cluster) -> PublishedRun:
    """``run`` with the stages per rank its estimate picks pinned (so the fit simulates one schedule per run)."""
    if run.virtual is not None or run.pp == 1:
        return run
    e = published_estimate(run, profiles(run), run_cluster(run, clusters={run.gpu: cluster}))
    return run.model_copy(update={"virtual": e.candidate.num_virtual})


def _cost(r: torch.Tensor, x: torch.Tensor, x0: torch.Tensor, weights: torch.Tensor) -> float:
    return float(r.pow(2).sum() + (weights * (x - x0)).pow(2).sum())


def summarize(rows: list[RowResult]) -> dict:
    """{'fit' / 'held_out' / 'all': (rows, median |error|, largest |error|)} of the estimates."""
    out = {}
    for name, pick in (("fit", lambda r: not r.run.held_out), ("held_out", lambda r: r.run.held_out),
                       ("all", lambda r: True)):
        errors = [abs(r.error) for r in rows if pick(r)]
        out[name] = (len(errors), statistics.median(errors) if errors else 0.0, max(errors, default=0.0))
    return out
