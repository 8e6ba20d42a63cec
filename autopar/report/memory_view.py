"""Memory per rank for the report: the memory calculator's breakdown, or parameter bytes alone.

:func:`rank_memory` asks :func:`autopar.memory.estimate_memory` for every rank's parameters,
gradients, optimizer state and activations. Where the calculator cannot answer (it is missing,
or the plan was built for a few ranks only), it falls back to the bytes of the parameters each
rank's stage graphs read, and says so in :attr:`MemoryTable.note`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from html import escape

from autopar.ir.meta_keys import PARAM, TENSOR, get_meta
from autopar.planning import coords_of

__all__ = ["MemoryTable", "rank_memory", "param_bytes", "memory_html", "format_bytes", "formula_html"]

log = logging.getLogger(__name__)

_COLORS = {"params": "#4C72B0", "masters": "#8172B3", "grads": "#55A868", "optimizer": "#DD8452",
           "activations": "#C44E52", "buffers": "#937860"}


@dataclass(frozen=True)
class MemoryTable:
    """Per rank: ``(rank, coords, {component: bytes})``; ``source`` says where the figures come from."""

    rows: tuple
    source: str
    note: str = ""


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``640 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def param_bytes(stages) -> int:
    """Bytes of the distinct parameters and buffers that ``stages`` (StageGraphs) read."""
    seen: dict[str, int] = {}
    for s in stages:
        for node in s.gm.graph.nodes:
            info = get_meta(node, TENSOR)
            if node.op == "get_attr" and info is not None:
                param = get_meta(node, PARAM)
                seen[param.name if param else str(node.target)] = info.nbytes
    return sum(seen.values())


def _from_calculator(result) -> MemoryTable:
    from autopar.memory import estimate_memory

    estimate = estimate_memory(result)
    rows = []
    for rank, r in sorted(estimate.ranks.items()):
        parts = {"params": r.params, "masters": r.master_params, "grads": r.grads, "optimizer": r.optimizer,
                 "activations": r.activations, "buffers": r.buffers}
        rows.append((rank, dict(r.coords), parts))
    source = (f"autopar.memory.estimate_memory: ZeRO-{estimate.zero_stage}, {estimate.precision}, "
              f"{estimate.optimizer} optimizer, activations at the schedule's peak")
    return MemoryTable(rows=tuple(rows), source=source)


def rank_memory(result) -> MemoryTable:
    """Every rank's memory: the calculator's figures when it answers, else parameter bytes."""
    try:
        return _from_calculator(result)
    except Exception as exc:  # the report must render even when the calculator cannot answer
        log.warning("memory calculator unavailable (%s); showing parameter bytes only", exc)
        reason = f"{type(exc).__name__}: {exc}"
    shape = result.plan.mesh
    rows = []
    for rank in range(shape.world_size):
        stages = result.rank_program(rank).stages
        rows.append((rank, coords_of(rank, shape), {"params": param_bytes(stages)}))
    note = ("The memory calculator (autopar.memory) could not answer for this plan "
            f"({reason}), so only the bytes of the parameters each rank's stage graphs hold are shown: "
            "no gradients, optimizer state or activations.")
    return MemoryTable(rows=tuple(rows), source="parameter bytes of each rank's stage graphs", note=note)


def memory_html(table: MemoryTable) -> str:
    """A table of ranks with a stacked bar each, scaled to the largest rank."""
    totals = [sum(parts.values()) for _r, _c, parts in table.rows]
    top = max(totals, default=0) or 1
    components = [k for k in _COLORS if any(parts.get(k) for _r, _c, parts in table.rows)] or ["params"]
    head = "".join(f"<th>{k}</th>" for k in components)
    body = []
    for (rank, coords, parts), total in zip(table.rows, totals):
        bar = "".join(f'<span class="seg" style="width:{100 * parts.get(k, 0) / top:.2f}%;background:{_COLORS[k]}" '
                      f'title="{k} {format_bytes(parts.get(k, 0))}"></span>' for k in components)
        cells = "".join(f"<td>{format_bytes(parts.get(k, 0))}</td>" for k in components)
        where = " ".join(f"{a}={coords[a]}" for a in ("dp", "pp", "tp"))
        body.append(f'<tr class="mem-row"><td>rank {rank}</td><td>{where}</td>{cells}'
                    f'<td><b>{format_bytes(total)}</b></td><td class="bar"><div class="stack">{bar}</div></td></tr>')
    legend = " ".join(f'<span class="key" style="background:{_COLORS[k]}"></span>{k}' for k in components)
    note = f'<p class="note">{escape(table.note)}</p>' if table.note else ""
    return (f'<p class="source">Figures from {escape(table.source)}. {legend}</p>{note}'
            f'<table class="memory"><tr><th>rank</th><th>coords</th>{head}<th>total</th><th></th></tr>'
            + "".join(body) + "</table>")


def formula_html(result, *, capacity: float | None = None) -> str:
    """Memory as a formula of microbatch size ``b`` and sequence length ``s`` (per pp rank, the fullest of its
    ranks), and with a capacity the longest sequence and largest microbatch that fit; a note if it cannot."""
    from autopar.memory.formula import memory_formula
    from autopar.memory.solve import describe, fit_report

    try:
        formula = memory_formula(result)
    except Exception as exc:  # the report must render even when the formula cannot be made
        log.warning("memory formula unavailable (%s)", exc)
        return f'<p class="note" id="formula">Memory as a formula: not available ({escape(type(exc).__name__)}: ' \
               f"{escape(str(exc))}).</p>"
    if capacity is None and getattr(result, "planner", None) is not None:
        cluster = result.planner.cluster
        capacity = min(cluster.usable_bytes(r) for r in range(result.plan.mesh.world_size))
    fullest = {}
    for rank in formula.states:
        pp = formula.coords[rank]["pp"]
        if pp not in fullest or formula.bytes(rank) > formula.bytes(fullest[pp]):
            fullest[pp] = rank
    rows = "".join(f'<tr class="formula-row"><td>pp rank {pp} (rank {r})</td><td><code>{escape(describe(formula.expr(r)))}'
                   f"</code></td></tr>" for pp, r in sorted(fullest.items()))
    solved = "".join(f"<li>{escape(line)}</li>" for line in fit_report(formula, capacity=capacity)[1:]) \
        if capacity else "<li>give write_report(capacity=bytes per device) for the longest sequence that fits</li>"
    return (f'<h3>As a formula</h3><div id="formula"><p class="source">Bytes of the fullest rank of each pipeline '
            f"rank, b = microbatch size (now {formula.microbatch_size}), s = sequence length (now "
            f"{formula.seq_len}); equal to the calculator at every size (autopar.memory.memory_formula).</p>"
            f'<table class="memory-formula">{rows}</table><ul id="fits">{solved}</ul></div>')
