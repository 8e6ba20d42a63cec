"""The search: every dp x pp x tp mesh, microbatch count, schedule, ZeRO stage and recompute mode.

1. *Structures* (mesh, microbatches, schedule, virtual stages) are enumerated: tp divides a node's
   devices (so tensor-parallel collectives stay on the fast link), pp x virtual stages is at most the
   number of chunks, dp divides the global batch. Each gets stage boundaries from
   :func:`autopar.planner.stage_cuts.weighted_cuts` on its chunk times (heavy first and last chunks,
   per-stage device speeds) and two estimates: the fastest settings (no ZeRO, no recompute) and the
   most frugal ones (ZeRO-3, full recompute). A structure that does not fit even frugally is rejected
   with the bytes it needs; the rest are ordered by their fastest time.
2. The most promising structures try every ZeRO stage and recompute mode; a variant that does not
   fit is retried with memory-aware boundaries (stages sized to each device's memory), else rejected.
3. The fastest fitting candidates are simulated (:mod:`autopar.runtime.schedules.simulator`) and
   ranked; the first is the choice, and :func:`explain` says why it beat its neighbours.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from autopar.errors import AutoparError, PlanError
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import SPLIT_BACKWARD, Candidate, CostModel, Estimate, schedule_of
from autopar.planner.profile import RECOMPUTE, ModelProfile
from autopar.planner.stage_cuts import weighted_cuts

__all__ = ["SearchSpace", "SearchResult", "search", "explain", "format_table"]

log = logging.getLogger(__name__)

_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("gpipe", 1), ("zb_v", 2))
GiB = 2**30


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; a field set to a value pins it (e.g. ``tp=(8,)``)."""

    dp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    num_microbatches: tuple[int, ...] | None = None
    schedules: tuple[tuple[str, int], ...] = _SCHEDULES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    max_structures: int = 48  # structures explored in full (step 2)
    simulate_top: int = 12


@dataclass
class SearchResult:
    """Ranked candidates that fit, rejected ones with reasons, and every estimate made."""

    ranked: list[Estimate]
    rejected: list[tuple[Candidate, str]]
    estimates: dict = field(default_factory=dict)  # Candidate (cuts cleared) -> Estimate
    world: int = 1
    cluster: Cluster | None = None
    global_batch: int = 1

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            raise PlanError("no candidate plan fits the cluster", where="autopar planner",
                            fix="use more devices, bf16, a smaller batch, or see the rejected plans: "
                                + "; ".join(f"{c.label()}: {r}" for c, r in self.rejected[:3]))
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatch_options(local: int, pp: int, pinned) -> list[int]:
    if pinned:
        return [m for m in pinned if local % m == 0]
    divs = _divisors(local)
    if pp == 1:
        return sorted({1, *[d for d in divs if d in (2, 4, 8)]})
    multiples = [d for d in divs if d % pp == 0]
    picks = {d for d in multiples if d // pp in (1, 2, 4, 8)}
    if multiples:
        picks.add(max((d for d in multiples if d <= 8 * pp), default=multiples[0]))
    return sorted(picks) or [d for d in divs if d >= pp][:1] or [divs[-1]]


def _meshes(world: int, profile: ModelProfile, cluster: Cluster, space: SearchSpace, rejected):
    for tp in _divisors(world):
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
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if (space.pp and pp not in space.pp) or (space.dp and dp not in space.dp):
                continue
            if pp > profile.num_chunks:
                continue
            if profile.global_batch % dp:
                rejected.append((Candidate(dp, pp, tp, 1), f"global batch {profile.global_batch} is not "
                                                           f"divisible by dp={dp}"))
                continue
            if profile.batch_statistics and dp > 1:
                rejected.append((Candidate(dp, pp, tp, 1), "batch statistics (BatchNorm) need dp=1"))
                continue
            yield dp, pp, tp


class _Cuts:
    """Stage boundaries per (tp, microbatch size, recompute, stages, speeds), cached."""

    def __init__(self, model: CostModel):
        self.model, self.cache = model, {}

    def __call__(self, c: Candidate, fits=None) -> tuple[int, ...]:
        if c.num_stages == 1:
            return ()
        schedule, _ = schedule_of(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
        speeds = _stage_speeds(self.model.cluster, c, schedule.stage_to_rank)
        key = (c.tp, c.dp * c.num_microbatches, c.recompute, c.num_stages, speeds)
        if fits is None and key in self.cache:
            return self.cache[key]
        cuts = tuple(weighted_cuts(self.model.chunk_costs(c), c.num_stages, speeds=speeds, fits=fits))
        if fits is None:
            self.cache[key] = cuts
        return cuts


def _stage_speeds(cluster: Cluster, c: Candidate, owner) -> tuple[float, ...]:
    if not cluster.groups:
        return (1.0,) * c.num_stages
    base = cluster.device.matmul_rate("fp32")
    per_rank = []
    for q in range(c.pp):
        ranks = [(d * c.pp + q) * c.tp + t for d in range(c.dp) for t in range(c.tp)]
        per_rank.append(min(cluster.device_of(r).matmul_rate("fp32") for r in ranks) / base)
    return tuple(per_rank[owner[s]] for s in range(c.num_stages))


def _structures(world, profile, cluster, space, rejected):
    for dp, pp, tp in _meshes(world, profile, cluster, space, rejected):
        local = profile.global_batch // dp
        pinned = space.num_microbatches
        if profile.batch_statistics:
            pinned = (1,)
        for m in _microbatch_options(local, pp, pinned):
            options = [("1f1b", 1)] if pp == 1 else space.schedules
            for name, v in options:
                if pp * v > profile.num_chunks:
                    continue
                try:
                    schedule_of(name, pp, m, v)
                except AutoparError as exc:
                    rejected.append((Candidate(dp, pp, tp, m, name, v), exc.what))
                    continue
                yield Candidate(dp, pp, tp, m, name, v, zero_stage=0, recompute="none")


def fmt_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps a digit before the point (GiB, MiB, KiB)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _memory_reason(e: Estimate) -> str:
    return (f"needs {fmt_bytes(e.memory)} on its fullest rank, has {fmt_bytes(e.capacity)} "
            f"(activations {fmt_bytes(e.memory_parts.get('activations', 0))}, "
            f"optimizer state {fmt_bytes(e.memory_parts.get('optimizer', 0))})")


def search(profile: ModelProfile, cluster: Cluster, *, world: int, space: SearchSpace = SearchSpace(),
           optimizer: str = "adam") -> SearchResult:
    """Rank the candidate plans for ``world`` ranks of ``cluster``."""
    rejected: list = []
    estimates: dict = {}
    model = CostModel(profile, cluster, optimizer=optimizer)
    cuts = _Cuts(model)

    def evaluate(c: Candidate, fits=None) -> Estimate:
        c = replace(c, cuts=cuts(c, fits))
        key = replace(c, cuts=())
        if fits is None and key in estimates:
            return estimates[key]
        e = model.estimate(c)
        estimates[key] = e
        return e

    frugal_zero = max(space.zero_stages)
    frugal_rc = "full" if "full" in space.recompute else space.recompute[-1]
    scored = []
    for c in _structures(world, profile, cluster, space, rejected):
        fast = replace(c, zero_stage=min(space.zero_stages) if c.dp > 1 else 0, recompute=space.recompute[0])
        zero = frugal_zero if c.dp > 1 else 0
        if zero == 3 and c.schedule in SPLIT_BACKWARD:  # (ZeRO-3 gathers are not split into B and W)
            zero = max([z for z in space.zero_stages if z < 3], default=3)
        frugal = replace(c, zero_stage=zero, recompute=frugal_rc)
        try:
            e_fast, e_frugal = evaluate(fast), evaluate(frugal)
            if not e_frugal.fits and c.num_stages > 1:  # stages sized to each rank's memory
                e_frugal = evaluate(frugal, fits=_memory_fits(frugal, profile, cluster))
        except AutoparError as exc:
            rejected.append((c, exc.what))
            continue
        if not e_frugal.fits:
            rejected.append((frugal, "does not fit even with ZeRO-3 and full recompute: " + _memory_reason(e_frugal)))
            continue
        scored.append((e_fast.step_time, c))
    scored.sort(key=lambda t: t[0])
    fitting = _explore([c for _, c in scored[: space.max_structures]], space, evaluate, profile, cluster,
                       rejected)
    for _, c in scored[space.max_structures:]:
        rejected.append((c, "not explored: slower than the explored structures even without ZeRO or recompute"))
    ranked = _simulate_top(fitting, model, space.simulate_top)
    return SearchResult(ranked=ranked, rejected=rejected, estimates=estimates, world=world, cluster=cluster,
                        global_batch=profile.global_batch)


def _explore(structures, space, evaluate, profile, cluster, rejected) -> list[Estimate]:
    fitting = []
    for c in structures:
        for zero in (space.zero_stages if c.dp > 1 else (0,)):
            if zero == 3 and c.schedule in SPLIT_BACKWARD:
                rejected.append((replace(c, zero_stage=3), f"ZeRO-3 does not combine with {c.schedule}: its W "
                                                           f"action computes weight gradients outside the "
                                                           f"graph's reduce-scatter"))
                continue
            for rc in space.recompute:
                cand = replace(c, zero_stage=zero, recompute=rc)
                if rc == "selective" and c.schedule in SPLIT_BACKWARD:
                    rejected.append((cand, f"selective recompute does not combine with {c.schedule}: its W action "
                                           f"walks each recomputed region a second time"))
                    continue
                try:
                    e = evaluate(cand)
                    if not e.fits and cand.num_stages > 1:
                        e = evaluate(cand, fits=_memory_fits(cand, profile, cluster))
                except AutoparError as exc:
                    rejected.append((cand, exc.what))
                    continue
                if e.fits:
                    fitting.append(e)
                else:
                    rejected.append((e.candidate, _memory_reason(e)))
    return fitting


def _memory_fits(c: Candidate, profile: ModelProfile, cluster: Cluster):
    """fits(stage, begin, end): a linear memory model of the stage for memory-aware boundaries."""
    chunks = profile.chunks[c.tp]
    b = profile.global_batch // (c.dp * c.num_microbatches)
    schedule, counts = schedule_of(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
    per_elem = _state_bytes_per_element(c.zero_stage, c.dp, profile.precision)
    prefix_state, prefix_act, acc_s, acc_a = [0.0], [0.0], 0.0, 0.0
    for ch in chunks:
        acc_s += sum(p.numel for p in ch.params) * per_elem + ch.buffer_bytes
        acc_a += ch.saved[c.recompute] * b
        prefix_state.append(acc_s)
        prefix_act.append(acc_a)

    def fits(stage: int, lo: int, hi: int) -> bool:
        q = schedule.stage_to_rank[stage]
        in_flight = -(-counts[q] // c.num_virtual)
        need = prefix_state[hi] - prefix_state[lo] + in_flight * (prefix_act[hi] - prefix_act[lo])
        return need <= cluster.usable_bytes(q * c.tp) / c.num_virtual
    return fits


def _state_bytes_per_element(zero: int, dp: int, precision: str) -> float:
    p = 2 if precision == "bf16" else 4
    master = 4 if precision == "bf16" else 0
    if dp == 1 or zero == 0:
        return p + master + 4 + 8
    if zero == 1:
        return p + master + 4 + 8 / dp
    if zero == 2:
        return p + master + (4 + 8) / dp
    return (p + master + 4 + 8) / dp


def _ranked(estimates: list[Estimate], *, tie: float = 0.01) -> list[Estimate]:
    """Fastest first; a run of estimates within ``tie`` of its fastest is ordered simplest first
    (less ZeRO, less recomputation, fewer virtual stages): the model cannot tell them apart."""
    ordered = sorted(estimates, key=lambda e: e.step_time)
    out, i = [], 0
    while i < len(ordered):
        j = i
        while j < len(ordered) and ordered[j].step_time <= ordered[i].step_time * (1 + tie):
            j += 1
        out += sorted(ordered[i:j], key=lambda e: (e.candidate.zero_stage, RECOMPUTE.index(e.candidate.recompute),
                                                   e.candidate.num_virtual, e.step_time))
        i = j
    return out


def _simulate_top(fitting: list[Estimate], model: CostModel, top: int) -> list[Estimate]:
    fitting = _ranked(fitting)
    head = [model.estimate(e.candidate, simulate_pipeline=True) for e in fitting[:top]]
    return _ranked(head) + fitting[top:]


def explain(result: SearchResult) -> list[str]:
    """Why the best candidate won: for each decision, the best alternative and what it lacked."""
    best = result.best
    c = best.candidate
    lines = [f"chosen: {c.label()}: {best.step_time:.4g} s/step estimated, "
             f"{fmt_bytes(best.memory)} of {fmt_bytes(best.capacity)} on the fullest rank"]
    axes = (("mesh", lambda x: (x.dp, x.pp, x.tp) != (c.dp, c.pp, c.tp)),
            ("microbatches", lambda x: (x.dp, x.pp, x.tp, x.schedule) == (c.dp, c.pp, c.tp, c.schedule)
             and x.num_microbatches != c.num_microbatches),
            ("schedule", lambda x: (x.dp, x.pp, x.tp, x.num_microbatches) == (c.dp, c.pp, c.tp, c.num_microbatches)
             and x.schedule != c.schedule),
            ("ZeRO", lambda x: _same_but(x, c, "zero_stage")),
            ("recompute", lambda x: _same_but(x, c, "recompute")))
    everything = list(result.estimates.values())
    for name, differs in axes:
        alts = [e for e in everything if differs(e.candidate)]
        faster = [e for e in alts if e.step_time < best.step_time]
        if faster:
            alt = min(faster, key=lambda e: e.step_time)
            lines.append(f"{name}: {alt.candidate.label()} would take {alt.step_time:.4g} s but "
                         + (_memory_reason(alt) if not alt.fits else "it fits; the simulator ranks it lower"))
        elif alts:
            alt = min(alts, key=lambda e: e.step_time)
            lines.append(f"{name}: the best alternative, {alt.candidate.label()}, is slower: "
                         f"{alt.step_time:.4g} s (+{(alt.step_time / best.step_time - 1) * 100:.0f}%)"
                         + ("" if alt.fits else " and does not fit"))
    lines.append(_time_breakdown(best))
    return lines


def _same_but(x: Candidate, c: Candidate, field_name: str) -> bool:
    a, b = replace(x, cuts=()), replace(c, cuts=())
    return getattr(a, field_name) != getattr(b, field_name) and replace(a, **{field_name: getattr(b, field_name)}) == b


def _time_breakdown(e: Estimate) -> str:
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in e.parts.items() if v > 0)
    return f"step time: {parts}"


def format_table(result: SearchResult, *, top: int = 10, rejected: int = 5) -> str:
    """The ranked candidates (and a few rejected ones with their reasons) as a text table."""
    head = ("#", "dp", "pp", "tp", "m", "mb", "schedule", "ZeRO", "recompute", "est. s/step", "bubble",
            "GiB/rank", "of GiB")
    rows = []
    for i, e in enumerate(result.ranked[:top], 1):
        c = e.candidate
        mb = result.global_batch // (c.dp * c.num_microbatches)
        bubble = e.parts.get("bubble", 0.0) / e.step_time if e.step_time else 0.0
        rows.append((str(i), str(c.dp), str(c.pp), str(c.tp), str(c.num_microbatches), str(mb),
                     c.schedule + (f" v={c.num_virtual}" if c.num_virtual > 1 else ""), str(c.zero_stage),
                     c.recompute, f"{e.step_time:.4g}" + ("" if e.simulated else "*"), f"{bubble:.0%}",
                     f"{e.memory / GiB:.1f}", f"{e.capacity / GiB:.1f}"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
    lines = [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    if any(not e.simulated for e in result.ranked[:top]):
        lines.append("* analytic pipeline bound (not simulated)")
    if rejected and result.rejected:
        lines.append(f"rejected ({len(result.rejected)}), e.g.:")
        shown = _varied(result.rejected, rejected)
        lines += [f"  {c.label()}: {reason}" for c, reason in shown]
    return "\n".join(lines)


def _varied(rejected, count):
    """Up to ``count`` rejections with different reasons."""
    seen, out = set(), []
    for c, reason in rejected:
        key = reason.split(":")[0][:40]
        if key not in seen:
            seen.add(key)
            out.append((c, reason))
        if len(out) == count:
            break
    return out
