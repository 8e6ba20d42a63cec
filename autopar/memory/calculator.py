"""The model memory calculator: per-rank bytes of a plan, in one plain process.

    >>> import autopar
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), lm_loss, y = gpt_tiny()
    >>> result = autopar.plan(model, (2, 2, 1), example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    >>> estimate = estimate_memory(result, optimizer="adam")
    >>> estimate.ranks[0].total            # bytes rank 0 holds at its peak
    349964

For each rank: parameters, fp32 masters (bf16 only), gradients and optimizer state
(:mod:`autopar.memory.states`, by ZeRO stage and precision), buffers, and activations
(:mod:`autopar.memory.activations`: bytes saved per microbatch of each stage, weighted by the
schedule's in-flight microbatches, plus the largest recompute transient), and under an asynchronous
schedule the weight versions (:mod:`autopar.memory.versions`: the weight copies in-flight
microbatches read, the gradients of updates not applied yet and PipeMare's velocity, each the size
of the rank's weights; such a rank keeps no other gradient). Ranks that share (pp, tp)
coordinates share their graphs, so a 1,024-rank plan costs one fake forward per stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.memory.activations import StageActivations, peak_bytes, stage_activations
from autopar.memory.states import StateFigures, owned_names, rank_params, state_figures
from autopar.memory.versions import steady_stream, weight_buffers

__all__ = ["RankMemory", "MemoryEstimate", "estimate_memory"]

GiB = 2**30


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes, at the peak of a training step."""

    rank: int
    coords: dict
    params: int
    master_params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int  # peak: in-flight microbatches' saved bytes + the largest recompute transient
    peak_in_flight: int  # most (stage, microbatch) forwards held at once (the simulator's peak_activations)
    per_microbatch: dict = field(default_factory=dict)  # {stage: bytes one microbatch saves}
    weight_versions: int = 0  # asynchronous schedules: weight copies, pending updates' gradients, velocity (peak)

    @property
    def model_states(self) -> int:
        """Parameters, masters, gradients and optimizer state."""
        return self.params + self.master_params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.buffers + self.activations + self.weight_versions


@dataclass(frozen=True)
class MemoryEstimate:
    """Every rank's :class:`RankMemory` and the settings they assume."""

    ranks: dict[int, RankMemory]
    optimizer: str
    zero_stage: int
    precision: str
    at_bound: str = ""  # the symbolic dims the activations are figured at ("seq 64"): their bound

    def peak_rank(self) -> RankMemory:
        """The rank that needs the most memory."""
        return max(self.ranks.values(), key=lambda r: (r.total, -r.rank))

    def summary(self) -> str:
        """A short table: the peak rank's breakdown in GiB."""
        r = self.peak_rank()
        parts = [("params", r.params), ("masters", r.master_params), ("grads", r.grads),
                 ("optimizer", r.optimizer), ("activations", r.activations), ("buffers", r.buffers)]
        if r.weight_versions:
            parts.append(("weight versions", r.weight_versions))
        body = ", ".join(f"{name} {value / GiB:.2f}" for name, value in parts)
        bound = f"; activations at the bound {self.at_bound}" if self.at_bound else ""
        return (f"peak rank {r.rank} {r.coords}: {r.total / GiB:.2f} GiB ({body}); "
                f"ZeRO-{self.zero_stage}, {self.precision}, {self.optimizer}{bound}")


def bound_sizes(dynamic: tuple) -> dict[str, int]:
    """{symbol: its bound} of the symbolic dims that have one."""
    return {d.symbol: d.high for d in dynamic if d.high is not None}


def _activations(result, pp: int, stages, memo: dict) -> tuple[int, int, dict]:
    """(peak bytes, peak count, bytes per microbatch by stage) of pp rank ``pp``."""
    schedule = result.schedule
    per_stage: dict[int, StageActivations] = {}
    for s in stages:  # symbolic dims at their bound: the longest batch the plan takes (docs/batches.md)
        per_stage[s.stage] = stage_activations(s.gm, memo=memo, dynamic=s.dynamic, sizes=bound_sizes(s.dynamic))
    row = schedule.actions[pp]
    saved = {s: a.saved for s, a in per_stage.items()}
    peak = peak_bytes(row, saved, split_backward=schedule.split_backward)
    count = peak_bytes(row, dict.fromkeys(saved, 1), split_backward=schedule.split_backward)
    transient = max((a.transient for a in per_stage.values()), default=0)
    return peak + transient, count, saved


def estimate_memory(result, *, optimizer: str = "adam", zero_stage: int | None = None) -> MemoryEstimate:
    """Per-rank memory of ``result`` (an :class:`autopar.PlanResult`) for an optimizer kind.

    ``optimizer``: ``"sgd"`` (no state), ``"momentum"`` (SGD with momentum), ``"adam"``/``"adamw"``.
    ``zero_stage`` overrides the plan's for the model states (what-if); precision and recompute
    are read from the plan's graphs. Every rank the result has built is estimated (all of them
    from a plain :func:`autopar.plan`; with ``ranks=`` only those).
    """
    plan = result.plan
    zero = plan.zero_stage if zero_stage is None else zero_stage
    stage_to_rank = result.schedule.stage_to_rank
    local = frozenset(plan.expert_params)  # MoE experts split over ep: ZeRO-1/2 partition them over edp
    activations, groups, memo = {}, {}, {}
    copies = weight_buffers(steady_stream(result.schedule))  # per pp rank; 0 under a synchronous schedule
    for graphs in result.ranks.values():
        c = graphs.coords
        stages = [s for s in _stages(result, c["pp"], c["tp"]) if stage_to_rank[s.stage] == c["pp"]]
        if c["pp"] not in activations:  # tp ranks share shapes: the first built stands for all
            activations[c["pp"]] = _activations(result, c["pp"], stages, memo)
        if (c["pp"], c["tp"]) not in groups:
            params, buffers = rank_params(stages)
            ways = plan.dims.dcp  # ZeRO-1/2 partition over dp x cp (dp without cp)
            owned = owned_names(params, dp=ways, local=local) if zero in (1, 2) and ways > 1 else None
            groups[(c["pp"], c["tp"])] = (params, buffers, owned)
    ranks = {}
    for rank, graphs in result.ranks.items():
        c = graphs.coords
        params, buffers, owned = groups[(c["pp"], c["tp"])]
        states: StateFigures = state_figures(params, buffers, zero_stage=zero, dims=plan.dims, coords=c,
                                             precision=plan.precision, optimizer=optimizer, owned=owned,
                                             local=local)
        peak, count, saved = activations[c["pp"]]
        versions = copies[c["pp"]] * sum(p.numel * p.itemsize for p in params)  # each a copy of the weights
        asynchronous = result.schedule.staleness is not None  # its gradients are among the versions' buffers
        ranks[rank] = RankMemory(rank=rank, coords=dict(c), params=states.params,
                                 master_params=states.master_params, grads=0 if asynchronous else states.grads,
                                 optimizer=states.optimizer, buffers=states.buffers, activations=peak,
                                 peak_in_flight=count, per_microbatch=saved, weight_versions=versions)
    first = next(iter(result.ranks.values()))
    dims = next((s.dynamic for s in _stages(result, first.coords["pp"], first.coords["tp"])), ())
    at_bound = ", ".join(f"{d.label} {d.high}" for d in dims if d.high is not None)
    return MemoryEstimate(ranks=dict(sorted(ranks.items())), optimizer=optimizer, zero_stage=zero,
                          precision=plan.precision, at_bound=at_bound)


def _stages(result, pp: int, tp: int):
    """The stage graphs of tp rank ``tp`` holding pp rank ``pp``'s stages (the full lowering where built)."""
    if tp in result.lowered:
        return result.lowered[tp].stages
    return next(g.stages for g in result.ranks.values() if g.coords["pp"] == pp and g.coords["tp"] == tp)
