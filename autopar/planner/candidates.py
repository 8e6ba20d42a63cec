"""The space the planner searches: every dp x pp x tp mesh, microbatch count, schedule, virtual stages
and expert-parallel degree that can run (:class:`SearchSpace` pins any of them), enumerated as the
*structures* :func:`autopar.planner.search.search` expands (step 1 of its docstring), with the refusals
of those that cannot, and each pipeline rank's device speed.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.parallel_dims import ParallelDims
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import Candidate
from autopar.planner.schedule_shapes import schedule_of
from autopar.planner.profile import RECOMPUTE, ModelProfile
from autopar.runtime.schedules.registry import family, planner_schedules

__all__ = ["SearchSpace", "structures", "stage_speeds", "divisors", "MAX_VIRTUAL"]

_SCHEDULES = planner_schedules()  # the registry's (runtime/schedules/registry.py: Family.searched)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; a field set to a value pins it (e.g. ``tp=(8,)``).

    ``exact_top``: rows of the ranked table the search makes exact (every candidate that could come
    before or between them simulated); the first row, the choice, is always exact.
    """

    dp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    num_microbatches: tuple[int, ...] | None = None
    schedules: tuple[tuple[str, int], ...] = _SCHEDULES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    exact_top: int = 5
    virtual: tuple[int, ...] | None = None  # stages per rank of interleaved 1F1B; None: 2 and those that divide
    expert_parallel: tuple[int, ...] | None = None  # None: every ep dividing dp and each MoE layer's experts
    cp: tuple[int, ...] | None = None  # context parallelism; None: 1, and every cp when no plan fits without it
    cp_strategy: str = "auto"  # cp's attention: the options' cp_strategy ("auto": the cost model picks per plan)
    ep_refusal: str | None = None  # why the options given leave no ep > 1 (autopar.validation), if they do


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatch_options(local: int, pp: int, pinned) -> list[int]:
    """Every microbatch count that divides the ``local`` batch of a replica, down to one sample per
    microbatch (``pinned``: those of them asked for); a schedule refuses the counts it cannot run."""
    if pinned:
        return [m for m in pinned if local % m == 0]
    return divisors(local)


MAX_VIRTUAL = 8  # stages per rank the search tries beyond the family's own (interleaved 1F1B)


def _virtual_options(name: str, v: int, pp: int, profile: ModelProfile, space: SearchSpace) -> list[int]:
    """Stages per pp rank of schedule ``name``: its own ``v``; for a family that takes any number (interleaved
    1F1B), also every ``v`` up to :data:`MAX_VIRTUAL` that gives each stage as many blocks (Megatron-LM's
    condition), unless ``space.virtual`` pins them."""
    row = family(name)
    if row.fixed or pp == 1:
        return [v]
    if space.virtual:
        return [k for k in space.virtual if k >= row.minimum]
    blocks = sum(ch.is_block for ch in next(iter(profile.chunks.values())))
    more = [k for k in range(row.minimum, MAX_VIRTUAL + 1) if k != v and blocks % (pp * k) == 0]
    return [v, *more]


def _meshes(world: int, profile: ModelProfile, cluster: Cluster, space: SearchSpace, rejected):
    for tp in divisors(world):
        if space.tp and tp not in space.tp:
            continue
        if tp not in profile.chunks:
            if tp in profile.tp_errors:
                rejected.append((Candidate(world // tp, 1, tp, 1), f"tp={tp}: {profile.tp_errors[tp]}"))
            continue
        if cluster.devices_per_node % tp:
            rejected.append((Candidate(world // tp, 1, tp, 1),
                             f"tp={tp} does not divide the {cluster.devices_per_node} devices of a node: its "
                             f"all-reduces would cross nodes"))
            continue
        for pp in divisors(world // tp):
            for cp in space.cp or (1,):
                if (world // (tp * pp)) % cp:
                    continue
                dp = world // (tp * pp * cp)
                if (space.pp and pp not in space.pp) or (space.dp and dp not in space.dp):
                    continue
                if pp > profile.num_chunks:
                    continue
                if profile.global_batch % dp:
                    rejected.append((Candidate(dp, pp, tp, 1, cp=cp), f"global batch {profile.global_batch} is not "
                                                                      f"divisible by dp={dp}"))
                    continue
                if profile.batch_statistics and dp > 1:
                    rejected.append((Candidate(dp, pp, tp, 1, cp=cp), "batch statistics (BatchNorm) need dp=1"))
                    continue
                if cp > 1 and (not profile.seq_len or profile.seq_len % (2 * cp)):
                    rejected.append((Candidate(dp, pp, tp, 1, cp=cp), f"a sequence of {profile.seq_len} tokens does "
                                                                      f"not divide by 2 x cp = {2 * cp}"))
                    continue
                yield dp, pp, tp, cp


def stage_speeds(cluster: Cluster, c: Candidate, owner) -> tuple[float, ...]:
    if not cluster.groups:
        return (1.0,) * c.num_stages
    base = cluster.device.matmul_rate("fp32")
    per_rank = []
    for q in range(c.pp):
        ranks = [(d * c.pp + q) * c.tp + t for d in range(c.dcp) for t in range(c.tp)]  # (cp inside dp)
        per_rank.append(min(cluster.device_of(r).matmul_rate("fp32") for r in ranks) / base)
    return tuple(per_rank[owner[s]] for s in range(c.num_stages))


def structures(world, profile, cluster, space, rejected):
    for dp, pp, tp, cp in _meshes(world, profile, cluster, space, rejected):
        local = profile.global_batch // dp
        pinned = space.num_microbatches
        if profile.batch_statistics:
            pinned = (1,)
        for m in _microbatch_options(local, pp, pinned):
            options = [("1f1b", 1)] if pp == 1 else [(name, v) for name, v0 in space.schedules
                                                     for v in _virtual_options(name, v0, pp, profile, space)]
            for name, v in options:
                if pp * v > profile.num_chunks:
                    continue
                try:
                    schedule_of(name, pp, m, v)
                except AutoparError as exc:
                    rejected.append((Candidate(dp, pp, tp, m, name, v, cp=cp), exc.what))
                    continue
                for ep in (_ep_options(dp, pp, tp, profile, space, rejected) if cp == 1 else (1,)):
                    for strategy in cp_strategies(cp, tp, profile, space):
                        yield Candidate(dp, pp, tp, m, name, v, zero_stage=0, recompute="none", expert_parallel=ep,
                                        cp=cp, cp_strategy=strategy)


def cp_strategies(cp: int, tp: int, profile: ModelProfile, space: SearchSpace) -> tuple[str, ...]:
    """The attention strategies a candidate with ``cp`` may take at ``tp`` (``space.cp_strategy``: the one pinned,
    ``auto``: the ring always, the all-to-all where every attention's query heads on a tp rank divide by cp; the
    cost model then picks the faster, which the Plan pins)."""
    if cp == 1:
        return ("ring",)
    if space.cp_strategy != "auto":
        return (space.cp_strategy,)
    heads = [ch.attention_heads for ch in profile.chunks[tp] if ch.attention_heads]
    return ("ring", "all_to_all") if heads and all(h % cp == 0 for h in heads) else ("ring",)


def _ep_refusal(ep: int, profile: ModelProfile, space: SearchSpace) -> str | None:
    """Why this model and search space cannot split experts over ``ep`` ranks, else None."""
    layers = profile.moe_layers
    if not layers:
        return "no mixture-of-experts layer was recognised"
    if space.ep_refusal:
        return space.ep_refusal
    if profile.template is not None:
        return "expert_parallel does not combine with capturing identical blocks once yet (block_capture)"
    if any(m.form == "loop" for m in layers):
        return "an MoE layer runs every expert on every token (a ModuleList loop): nothing to dispatch"
    if any(m.num_experts % ep for m in layers):
        return f"expert_parallel={ep} does not divide the experts of every MoE layer"
    return None


def _ep_options(dp: int, pp: int, tp: int, profile: ModelProfile, space: SearchSpace, rejected) -> list[int]:
    """The ep degrees of a dp x pp x tp mesh: 1, and with recognised MoE layers every ep that divides dp and
    each layer's number of experts (refusals, once per mesh, in ``rejected``)."""
    layers = profile.moe_layers
    wanted = space.expert_parallel or divisors(dp)
    out = [ep for ep in wanted if ep == 1]
    for ep in (e for e in wanted if e > 1):
        c, problem = Candidate(dp, pp, tp, 1, expert_parallel=ep), ParallelDims.problem(dp=dp, pp=pp, tp=tp, ep=ep)
        why = problem[0] if problem else _ep_refusal(ep, profile, space)  # (ep divides dp: autopar/parallel_dims.py)
        if why is None:
            out.append(ep)
        elif layers or space.expert_parallel:
            if not any(r == why and x.expert_parallel == ep and (x.dp, x.pp, x.tp) == (dp, pp, tp)
                       for x, r in rejected):
                rejected.append((c, why))
    return out
