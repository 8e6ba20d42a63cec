"""What the planner says about its choice: the ranked table, the reasons it won, and warnings.

Every figure here is a simulated step time (:meth:`SearchResult.simulate`), the kind the table
ranks by, so a reason cannot contradict the table: for each decision (mesh, microbatches,
schedule, ZeRO stage, recomputation, expert parallelism, cp's attention strategy) :func:`explain` names the simulator's fastest alternative
that fits (found best-first, like the choice) and how much slower it is, and any faster
alternative with what it lacks (memory, or a combination the runtime refuses).
:func:`batch_warnings` says when the global batch is too small for the plan: a pipeline bubble
above a third of the step, or data parallelism capped by the batch, with the batch that would do.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

from autopar.errors import AutoparError
from autopar.planner.cost_model import CostModel, Estimate
from autopar.planner.search import GiB, TIE, SearchResult, _memory_reason, constraint, fmt_bytes

__all__ = ["explain", "format_table", "batch_warnings"]

_MESH = lambda x: (x.dp, x.cp, x.pp, x.tp)  # noqa: E731
_STRUCTURE = lambda x: (x.dp, x.cp, x.pp, x.tp, x.num_microbatches, x.schedule, x.num_virtual,  # noqa: E731
                        x.expert_parallel, x.cp_strategy)
_LAYOUT = lambda x: (x.dp, x.cp, x.pp, x.tp, x.num_microbatches, x.schedule, x.num_virtual)  # noqa: E731


def _axes(c):
    """(decision, a structure may hold an alternative, a candidate is an alternative) for each decision."""
    def other_mesh(x):
        return _MESH(x) != _MESH(c)

    def other_ep(x):  # the same structure with its MoE experts split over another ep
        return _LAYOUT(x) == _LAYOUT(c) and x.expert_parallel != c.expert_parallel

    def other_microbatches(x):
        return (_MESH(x) == _MESH(c) and (x.schedule, x.num_virtual) == (c.schedule, c.num_virtual)
                and x.num_microbatches != c.num_microbatches and x.expert_parallel == c.expert_parallel)

    def other_schedule(x):
        return (_MESH(x) == _MESH(c) and x.num_microbatches == c.num_microbatches
                and (x.schedule, x.num_virtual) != (c.schedule, c.num_virtual)
                and x.expert_parallel == c.expert_parallel)

    def same_structure(x):
        return _STRUCTURE(x) == _STRUCTURE(c)

    def other_cp_structure(x):  # the same structure with cp's other attention strategy
        return _STRUCTURE(replace(x, cp_strategy=c.cp_strategy)) == _STRUCTURE(c) and x.cp_strategy != c.cp_strategy

    def other_cp_attention(x):  # the same plan with cp's other attention strategy
        return other_cp_structure(x) and (x.zero_stage, x.recompute) == (c.zero_stage, c.recompute)

    def other_zero(x):
        return same_structure(x) and x.zero_stage != c.zero_stage and x.recompute == c.recompute

    def other_recompute(x):
        return same_structure(x) and x.recompute != c.recompute and x.zero_stage == c.zero_stage

    return (("mesh", other_mesh, other_mesh), ("microbatches", other_microbatches, other_microbatches),
            ("schedule", other_schedule, other_schedule), ("ZeRO", same_structure, other_zero),
            ("recompute", same_structure, other_recompute), ("expert parallel", other_ep, other_ep),
            ("cp attention", other_cp_structure, other_cp_attention))


def _pct(t: float, base: float) -> str:
    d = (t / base - 1) * 100
    return f"{d:+.2f}%" if abs(d) < 1 else f"{d:+.1f}%" if abs(d) < 10 else f"{d:+.0f}%"


def explain(result: SearchResult) -> list[str]:
    """Why the best candidate won: for each decision, the simulator's best alternative and what it lacked."""
    best = result.best
    c = best.candidate
    lines = [f"chosen: {c.label()}: {best.step_time:.4g} s/step simulated, "
             f"{fmt_bytes(best.memory)} of {fmt_bytes(best.capacity)} on the fullest rank"]
    for name, structure_ok, candidate_ok in _axes(c):
        lacking = _faster_lacking(result, best, candidate_ok)
        if lacking is not None:
            e, reason = lacking
            lines.append(f"{name}: {e.candidate.label()} would take {e.step_time:.4g} s "
                         f"({_pct(e.step_time, best.step_time)}) but {reason}")
        alt = result.best_where(structure_ok, candidate_ok)
        if alt is None:
            if lacking is None:
                lacking = _fastest_lacking(result, candidate_ok)
                if lacking is not None:
                    e, reason = lacking
                    lines.append(f"{name}: no alternative fits; the fastest, {e.candidate.label()}, would take "
                                 f"{e.step_time:.4g} s ({_pct(e.step_time, best.step_time)}) but {reason}")
            continue
        if alt.step_time <= best.step_time:  # only within the tie: the ranking prefers the simpler plan
            lines.append(f"{name}: {alt.candidate.label()} takes {alt.step_time:.4g} s "
                         f"({_pct(alt.step_time, best.step_time)}), within {TIE:.0%} of the choice, which is simpler "
                         f"(less ZeRO, less recomputation, fewer virtual stages)")
        else:
            lines.append(f"{name}: the best alternative that fits, {alt.candidate.label()}, is slower: "
                         f"{alt.step_time:.4g} s ({_pct(alt.step_time, best.step_time)})")
    lines += _ep_refusals(result, c)
    lines.append(_time_breakdown(best))
    return lines


def _ep_refusals(result: SearchResult, c) -> list[str]:
    """Why no ep > 1 was a candidate for the chosen mesh, when the model has MoE layers and none was."""
    if not result.cost_model.profile.moe_layers or any(
            _LAYOUT(x) == _LAYOUT(c) and x.expert_parallel != c.expert_parallel for x in result.frontier.structures):
        return []
    why = sorted({f"ep={x.expert_parallel}: {r}" for x, r in result.rejected
                  if x.expert_parallel > 1 and _MESH(x) == _MESH(c)})
    return ["expert parallel: ep=1, the only degree for this mesh"
            + (f" ({'; '.join(why)})" if why else f" (dp={c.dp})")]


def _fastest_lacking(result: SearchResult, candidate_ok):
    """(simulated estimate, memory it lacks) of the fastest alternative estimated that does not fit, or None."""
    found = None
    pool = sorted((e for e in result.estimates.values() if not e.fits and candidate_ok(e.candidate)),
                  key=lambda e: e.step_time)
    for e in pool:  # the closed form bounds the simulated time
        if found is not None and e.step_time >= found.step_time:
            break
        sim = result.simulate(e)
        found = sim if found is None or sim.step_time < found.step_time else found
    return None if found is None else (found, _memory_reason(found))


def _faster_lacking(result: SearchResult, best: Estimate, candidate_ok):
    """(simulated estimate, what it lacks) of the fastest alternative that beats ``best`` but does not
    fit, or that the runtime refuses (those of the chosen structure), or None."""
    pool = [(e, None) for e in result.estimates.values()
            if not e.fits and candidate_ok(e.candidate) and e.step_time < best.step_time]
    for c, reason in result.rejected:
        if candidate_ok(c) and _STRUCTURE(c) == _STRUCTURE(best.candidate) and constraint(c) == reason:
            try:
                e = result.evaluate(c)
            except AutoparError:
                continue
            if e.step_time < best.step_time:
                pool.append((e, reason))
    found = None
    for e, reason in sorted(pool, key=lambda t: t[0].step_time):  # the closed form bounds the simulated time
        if e.step_time >= (found[0].step_time if found else best.step_time):
            break
        sim = result.simulate(e)
        if sim.step_time < (found[0].step_time if found else best.step_time):
            lack = reason or _memory_reason(sim)
            if reason and not sim.fits:
                lack += " (and it " + _memory_reason(sim) + ")"
            found = (sim, lack)
    return found


def _time_breakdown(e: Estimate) -> str:
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in e.parts.items() if v > 0)
    return f"step time: {parts}"


def batch_warnings(result: SearchResult) -> list[str]:
    """Warnings when the global batch is too small for the chosen plan, each naming a batch that is not."""
    best = result.best
    out = []
    share = best.parts.get("bubble", 0.0) / best.step_time if best.step_time else 0.0
    if share > 1 / 3:
        out.append(_bubble_warning(result, best, share))
    capped = _dp_cap_warning(result, best)
    if capped:
        out.append(capped)
    return out


def _bubble_warning(result: SearchResult, best: Estimate, share: float) -> str:
    c, batch = best.candidate, result.global_batch
    b = batch // (c.dp * c.num_microbatches)
    head = (f"warning: the global batch of {batch} cannot fill the pipeline: its bubble is {share:.0%} of the step "
            f"({best.parts['bubble']:.3g} of {best.step_time:.4g} s)")
    model = result.cost_model
    for k in range(1, 13):
        m = c.num_microbatches * 2**k
        bigger = CostModel(replace(model.profile, global_batch=c.dp * m * b), model.cluster, optimizer=model.optimizer)
        cand = replace(c, num_microbatches=m)
        try:
            if _bubble_share(bigger.estimate(cand)) > 1 / 3:  # the bound's share is the lower: skip it
                continue
            sim = bigger.estimate(cand, simulate_pipeline=True)
        except AutoparError:
            continue
        if _bubble_share(sim) <= 1 / 3:
            return (head + f"; a global batch of {c.dp * m * b} ({m} microbatches of {b} per replica, "
                           f"dp={c.dp}) would bring it to {_bubble_share(sim):.0%}")
    return head + f"; no global batch up to {c.dp * c.num_microbatches * 2**12 * b} brings it under a third"


def _bubble_share(e: Estimate) -> float:
    return e.parts.get("bubble", 0.0) / e.step_time if e.step_time else 0.0


def _dp_cap_warning(result: SearchResult, best: Estimate) -> str | None:
    batch = result.global_batch
    prefix = f"global batch {batch} is not divisible by dp="
    refused = sorted({c.dp for c, reason in result.rejected if reason.startswith(prefix)})
    cap = max((c.dp for c in result.frontier.structures), default=best.candidate.dp)
    larger = [d for d in refused if d > cap]
    if best.candidate.dp < cap or not larger:
        return None
    nxt = larger[0]
    return (f"warning: the global batch of {batch} leaves ranks for more data-parallel replicas idle: dp={cap} is "
            f"the most it divides among the meshes of {result.world} ranks, and the chosen plan uses it; a global "
            f"batch of {math.lcm(batch, nxt)} would allow dp={nxt}")


def format_table(result: SearchResult, *, top: int = 10, rejected: int = 5) -> str:
    """The ranked candidates (simulated), what the search simulated, and a few rejected ones with reasons."""
    moe = bool(result.cost_model.profile.moe_layers)  # an ep column for models with MoE layers
    ranked, exact, floor = result.ranked, result.exact_rows, result.floor
    cp = any(e.candidate.cp > 1 for e in ranked[:min(top, exact)])  # a cp column when a shown row cuts sequences
    head = ("#", "dp", *(("cp",) if cp else ()), "pp", "tp", *(("ep",) if moe else ()), "m", "mb", "schedule", "ZeRO",
            "recompute", *(("cp attention",) if cp else ()), "est. s/step", "bubble", "GiB/rank", "of GiB")
    rows = []
    for i, e in enumerate(ranked[:min(top, exact)], 1):  # rows the simulator ranks against every candidate
        c = e.candidate
        mb = result.global_batch // (c.dp * c.num_microbatches)
        rows.append((str(i), str(c.dp), *((str(c.cp),) if cp else ()), str(c.pp), str(c.tp),
                     *((str(c.expert_parallel),) if moe else ()),
                     str(c.num_microbatches),
                     str(mb), c.schedule + (f" v={c.num_virtual}" if c.num_virtual > 1 else ""), str(c.zero_stage),
                     c.recompute, *(((c.cp_strategy if c.cp > 1 else "-"),) if cp else ()),
                     f"{e.step_time:.4g}", f"{_bubble_share(e):.0%}",
                     f"{e.memory / GiB:.1f}", f"{e.capacity / GiB:.1f}"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
    lines = [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    shown = min(top, exact)
    rest = min([floor] + [e.step_time for e in ranked[shown:]])  # simulated, or bounded below
    rest = ("no other candidate fits" if math.isinf(rest)
            else f"every other candidate takes at least {rest:.4g} s (simulated, or its closed-form lower bound)")
    lines.append(f"the search simulated {result.num_simulated} candidates best-first by their closed-form lower "
                 f"bounds ({len(result.estimates)} estimated) in {result.simulate_seconds:.2f} s of its "
                 f"{result.search_seconds:.2f} s; {rest}")
    if rejected and result.rejected:
        lines.append(f"rejected ({len(result.rejected)}), e.g.:")
        lines += [f"  {c.label()}: {reason}" for c, reason in _varied(result.rejected, rejected)]
    return "\n".join(lines)


def _varied(rejected, count):
    """Up to ``count`` rejections with different reasons."""
    seen, out = set(), []
    for c, reason in rejected:
        key = re.sub(r"[0-9.]+", "#", reason.split(":")[0])[:40]
        if key not in seen:
            seen.add(key)
            out.append((c, reason))
        if len(out) == count:
            break
    return out
