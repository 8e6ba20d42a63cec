"""The schedule's timeline as an inline SVG picture, drawn from the simulator (no matplotlib).

:func:`simulate_plan` times the plan's schedule with the simulator
(:func:`autopar.runtime.schedules.simulator.simulate`), each stage costing its forward FLOPs (read
from ``autopar.cost`` on tensor-parallel rank 0's stage graphs) for F, and as much again for each of
B and W. :func:`timeline_svg` draws one row per pipeline rank and one bar per action; with
``critical=True`` the step's critical path (``SimResult.critical_path``) is outlined in black and
joined by a line, transfers included.

    >>> from autopar.runtime.schedules.gpipe import gpipe
    >>> from autopar.runtime.schedules.simulator import StageCosts, simulate
    >>> sim = simulate(gpipe(num_ranks=2, num_microbatches=2), costs=StageCosts(forward=1, backward=1, weight=1))
    >>> svg = timeline_svg(sim)
    >>> svg.startswith("<svg") and svg.count('class="ev ev-F"')
    4
    >>> timeline_svg(sim, critical=True).count(' crit"')  # the path's actions: outlined
    6
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape

from autopar.report.collect import stage_flops, stage_graphs
from autopar.runtime.schedules.simulator import SimResult, StageCosts, simulate

__all__ = ["PlanTiming", "simulate_plan", "timeline_svg", "KIND_COLORS"]

KIND_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}
_LABEL_W, _ROW_H, _AXIS_H, _PAD = 64, 24, 30, 8


@dataclass(frozen=True)
class PlanTiming:
    """The simulated step: per-stage forward FLOPs, the costs given to the simulator, its result."""

    stage_flops: tuple[int, ...]
    costs: StageCosts
    sim: SimResult
    unit: str  # what one time unit of the picture is


def simulate_plan(result) -> PlanTiming:
    """Simulate ``result.schedule`` with costs proportional to each stage's forward FLOPs."""
    graphs = stage_graphs(result, tp=0)
    schedule = result.schedule
    flops = tuple(stage_flops(graphs[s].gm) if s in graphs else 0 for s in range(schedule.num_stages))
    top = max(flops, default=0)
    if top > 0:
        fwd = tuple(f / top for f in flops)
        unit = "the slowest stage's forward of one microbatch"
    else:  # no cost metadata: every stage alike
        fwd, unit = (1.0,) * schedule.num_stages, "one stage's forward of one microbatch (costs unknown)"
    costs = StageCosts(forward=fwd, backward=fwd, weight=fwd)
    return PlanTiming(stage_flops=flops, costs=costs, sim=simulate(schedule, costs=costs), unit=unit)


def _ticks(span: float) -> list[float]:
    """About six round tick positions in [0, span]."""
    if span <= 0:
        return [0.0]
    raw = span / 6
    magnitude = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1.0
    while magnitude > raw:
        magnitude /= 10
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def _bar(event, x0: float, scale: float, y: float, critical: bool = False) -> str:
    action = event.action
    kind = action.kind.name if hasattr(action.kind, "name") else str(action.kind)
    x, w = x0 + event.start * scale, max((event.end - event.start) * scale, 0.5)
    color = KIND_COLORS.get(kind, "#8C8C8C")
    title = f"{action}: stage {action.stage}, {kind}, microbatch {action.microbatch}, " \
            f"{event.start:.2f} to {event.end:.2f}" + (", on the critical path" if critical else "")
    stroke = 'stroke="#111" stroke-width="1.6"' if critical else 'stroke="#fff" stroke-width="0.6"'
    out = [f'<rect class="ev ev-{kind}{" crit" if critical else ""}" data-action="{escape(str(action))}" '
           f'x="{x:.1f}" y="{y + 2:.1f}" width="{w:.1f}" height="{_ROW_H - 4}" fill="{color}" {stroke}>'
           f'<title>{escape(title)}</title></rect>']
    if w >= 14:
        label = str(action.microbatch) if w < 34 else f"{action.stage}{kind}{action.microbatch}"
        out.append(f'<text x="{x + w / 2:.1f}" y="{y + _ROW_H / 2 + 4:.1f}" text-anchor="middle" '
                   f'font-size="10" fill="#fff">{label}</text>')
    return "".join(out)


def _path_line(sim: SimResult, path, x0: float, scale: float, top: float) -> str:
    """A line through the critical path: along each action, and across each transfer to the next rank."""
    row_of = {str(e.action): r for r, row in enumerate(sim.events) for e in row}
    points = []
    for step in path.steps:
        if step.kind == "transfer":
            continue
        y = top + row_of[step.label] * _ROW_H + _ROW_H / 2
        points += [(x0 + step.start * scale, y), (x0 + (step.start + step.seconds) * scale, y)]
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return (f'<polyline class="critical-path" points="{coords}" fill="none" stroke="#111" stroke-width="1.2" '
            f'stroke-dasharray="3,2"><title>critical path: {escape(path.summary())}</title></polyline>')


def timeline_svg(sim: SimResult, *, width: int = 960, title: str = "", critical: bool = False) -> str:
    """One row per pipeline rank, one bar per action (F blue, B green, W orange), a time axis below; with
    ``critical``, the critical path's bars outlined and joined."""
    rows = sim.events
    on_path = set(sim.critical_path.actions) if critical else set()
    span = max((e.end for row in rows for e in row), default=0.0) or 1.0
    plot_w = width - _LABEL_W - 2 * _PAD
    scale = plot_w / span
    top = 18 if title else 4
    height = top + len(rows) * _ROW_H + 4 + _AXIS_H + 8  # rows, axis, legend
    x0 = _LABEL_W + _PAD
    parts = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="schedule timeline">']
    if title:
        parts.append(f'<text x="{x0}" y="12" font-size="12" font-weight="bold">{escape(title)}</text>')
    for rank, row in enumerate(rows):
        y = top + rank * _ROW_H
        parts.append(f'<text x="{_LABEL_W}" y="{y + _ROW_H / 2 + 4}" text-anchor="end" font-size="11">'
                     f'pp rank {rank}</text>')
        parts.append(f'<rect x="{x0}" y="{y + 2}" width="{plot_w}" height="{_ROW_H - 4}" fill="#f2f2f2"/>')
        parts.extend(_bar(e, x0, scale, y, str(e.action) in on_path) for e in row)
    if critical:
        parts.append(_path_line(sim, sim.critical_path, x0, scale, top))
    axis_y = top + len(rows) * _ROW_H + 4
    parts.append(f'<line x1="{x0}" y1="{axis_y}" x2="{x0 + plot_w}" y2="{axis_y}" stroke="#555"/>')
    for t in _ticks(span):
        x = x0 + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#555"/>'
                     f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle" font-size="10">{t:g}</text>')
    legend_y = axis_y + _AXIS_H
    present = {e.action.kind.name for row in rows for e in row}
    for i, (kind, color) in enumerate((k, c) for k, c in KIND_COLORS.items() if k in present):
        lx = x0 + i * 110
        name = {"F": "forward", "B": "backward", "W": "weight grad"}[kind]
        parts.append(f'<rect x="{lx}" y="{legend_y - 9}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{legend_y}" font-size="10">{kind} {name}</text>')
    parts.append("</svg>")
    return "".join(parts)
