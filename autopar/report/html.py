"""The self-contained HTML report of a plan: everything autopar decided, on one page.

:func:`render_report` takes what :func:`autopar.plan` returned and builds one HTML document with no
external script, style sheet or image: the Plan (summary and JSON), the ranks of the mesh, the
schedule (its action lists and a timeline drawn from the simulator as inline SVG, its critical
path outlined and listed), memory per rank and as a formula of the microbatch size and sequence
length (with the longest sequence that fits a device), with expert parallelism which rank holds which experts and where tokens move
(:mod:`autopar.report.experts_view`), every distinct rewritten stage graph (one section per stage and
tensor-parallel rank, with the ranks that run it), and the captured graph before any transform.

    result = autopar.plan(model, {"dp": 2, "pp": 2, "tp": 2}, example_inputs=(tokens,), ...)
    write_report(result, "report.html")          # or: autopar inspect ... --html report.html
"""
from __future__ import annotations

from html import escape
from pathlib import Path

from autopar.errors import PlanError
from autopar.planning import coords_of
from autopar.report.collect import graph_groups, original_graph
from autopar.report.experts_view import expert_placement, experts_html
from autopar.report.graph_view import graph_section, legend_html, original_section, stage_color
from autopar.report.memory_view import formula_html, memory_html, rank_memory
from autopar.report.timeline import simulate_plan, timeline_svg

__all__ = ["render_report", "write_report"]

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0 auto;max-width:1180px;
 padding:16px 24px;color:#222;background:#fff;font-size:14px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:4px 0}
nav a{margin-right:14px}pre{background:#f6f8fa;padding:8px 10px;overflow-x:auto;font-size:12px;line-height:1.35}
table{border-collapse:collapse;font-size:12px}th,td{padding:2px 8px;text-align:left;vertical-align:top}
table.nodes td:nth-child(3){white-space:nowrap}
th{background:#eee}table.nodes{width:100%}table.nodes td:nth-child(2){font-family:ui-monospace,Menlo,monospace}
table.nodes code{white-space:pre-wrap;word-break:break-all}
tr.pl-S{background:#e3eefa}tr.pl-P{background:#fdeed6}tr.k-param td{color:#777}
tr.k-collective{background:#fbd3d3;font-weight:600}tr.k-send,tr.k-recv{background:#e8dcf7;font-weight:600}
.badge{display:inline-block;border-radius:3px;padding:0 5px;margin-right:4px;font-size:11px;color:#fff;
 font-family:system-ui,sans-serif;font-weight:600}
.badge.coll{background:#c62828}.badge.p2p{background:#6a3ab2}.badge.region{background:#b08800}
section.graph,section.original-graph{margin:14px 0;padding:6px 12px;background:#fcfcfc;border:1px solid #e5e5e5}
.who,.stats,.source,.note{margin:4px 0;color:#444}.note{color:#8a4b00}
.count-coll{color:#c62828;font-weight:600}.count-p2p{color:#6a3ab2;font-weight:600}
svg.strip{display:block;margin:6px 0;border:1px solid #ddd}
.legend-item{display:inline-block;padding:1px 8px;margin:2px 4px 2px 0;font-size:12px;border:1px solid #ddd}
.legend-item.pl-S{background:#e3eefa}.legend-item.pl-P{background:#fdeed6}.legend-item.k-collective{background:#fbd3d3}
.legend-item.k-send{background:#e8dcf7}.legend-item.k-param{color:#777}
table.memory td.bar{width:380px}.stack{display:flex;height:14px;background:#f2f2f2;width:380px}
.stack .seg{display:block;height:100%}.key{display:inline-block;width:10px;height:10px;margin:0 3px 0 8px}
td.experts{font-family:ui-monospace,Menlo,monospace;text-align:center}
.figures td{padding-right:18px}#formula code{font-size:12px}.stage-chip{display:inline-block;width:10px;height:10px;margin-right:4px}
"""


def _plan_section(result) -> str:
    json_text = result.plan.model_dump_json(indent=2)
    return (f'<section id="plan"><h2>Plan</h2><pre id="plan-summary">{escape(result.plan.summary())}</pre>'
            f'<details><summary>the Plan as JSON (edit it and pass it back with <code>plan=</code>)</summary>'
            f'<pre id="plan-json">{escape(json_text)}</pre></details></section>')


def _ranks_section(result, groups) -> str:
    shape = result.plan.mesh
    by_rank: dict[int, list] = {}
    for g in groups:
        for r in g.ranks:
            by_rank.setdefault(r, []).append(g)
    axes = [a for a in ("dp", "cp", "pp", "tp") if a != "cp" or shape.cp > 1]
    rows = []
    for rank in range(shape.world_size):
        c = coords_of(rank, shape)
        links = " ".join(f'<a href="#{g.anchor}"><span class="stage-chip" style="background:{stage_color(g.stage)}">'
                         f"</span>stage {g.stage}</a>" for g in sorted(by_rank.get(rank, []), key=lambda g: g.stage))
        rows.append(f'<tr class="rank-row" id="rank-{rank}"><td>rank {rank}</td>'
                    + "".join(f"<td>{c[a]}</td>" for a in axes) + f"<td>{links}</td></tr>")
    order = ("((dp &#183; cp_size + cp) &#183; pp_size + pp) &#183; tp_size + tp" if shape.cp > 1
             else "(dp &#183; pp_size + pp) &#183; tp_size + tp")
    same = "cp, pp and tp" if shape.cp > 1 else "pp and tp"
    return (f'<section id="ranks"><h2>Ranks</h2><p>{shape.world_size} ranks, rank = {order}. '
            f"Ranks with the same {same} run the same graphs on different data.</p>"
            "<table><tr><th>rank</th>" + "".join(f"<th>{a}</th>" for a in axes) + "<th>stage graphs</th></tr>"
            + "".join(rows) + "</table></section>")


def _flops(n: float) -> str:
    """``1.70 MFLOP``, ``512 FLOP``."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} FLOP"


def _schedule_section(result) -> str:
    schedule = result.schedule
    timing = simulate_plan(result)
    sim = timing.sim
    lists = "\n".join(f"pp rank {r}: " + " ".join(str(a) for a in row) for r, row in enumerate(schedule.actions))
    rows = "".join(f"<tr><td>pp rank {r}</td><td>{b:.1%}</td><td>{a}</td></tr>"
                   for r, (b, a) in enumerate(zip(sim.bubble_fraction, sim.peak_activations)))
    flops = ", ".join(f"stage {s}: {_flops(f)}" for s, f in enumerate(timing.stage_flops))
    title = f"{schedule.name}: {schedule.num_stages} stages on {schedule.num_ranks} pp ranks, " \
            f"{schedule.num_microbatches} microbatches"
    return (f'<section id="schedule"><h2>Schedule</h2><p>{escape(title)}. Simulated with each stage costing its '
            f"forward FLOPs per microbatch for F and as much again for each of B and W (tensor-parallel rank 0: "
            f"{escape(flops)}). One time unit is {escape(timing.unit)}. The critical path is outlined.</p>"
            f'<figure id="timeline">{timeline_svg(sim, title=title, critical=True)}</figure>'
            f'<table class="figures"><tr><th></th><th>bubble</th><th>peak microbatches held</th></tr>{rows}'
            f"<tr><td>step</td><td>{sim.mean_bubble:.1%} mean</td><td>step time {sim.step_time:.2f} units</td>"
            f"</tr></table>{_critical_path_html(sim.critical_path)}"
            f"<details><summary>action lists</summary><pre id=\"actions\">{escape(lists)}</pre>"
            f"</details></section>")


def _critical_path_html(path, *, unit: str = "units", anchor: str = "") -> str:
    """The critical path: its length, what each kind and each rank contributes, and the path itself."""
    total = path.length or 1.0
    kinds = {"F": "forward", "B": "backward", "W": "weight grad", "transfer": "transfers"}
    rows = "".join(f"<tr><td>{kinds[k]}</td><td>{v:.4g}</td><td>{v / total:.0%}</td></tr>"
                   for k, v in path.by_kind().items())
    rows += "".join(f"<tr><td>pp rank {r}</td><td>{v:.4g}</td><td>{v / total:.0%}</td></tr>"
                    for r, v in path.by_rank().items())
    return (f'<h3>Critical path</h3><p id="{anchor}critical-path">The actions and transfers that make the step '
            f"{path.length:.4g} {unit} long: each starts the moment the one before it ends, so shortening any of them "
            f"shortens the step (runtime/schedules/step_graph.py).</p>"
            f'<table class="figures critical"><tr><th></th><th>{unit}</th><th>share</th></tr>{rows}</table>'
            f'<pre id="{anchor}critical-actions">{escape(" ".join(s.label for s in path.steps))}</pre>')


def _measured_section(result, events) -> str:
    """A measured step (``runtime.execution.trace.gather_events``): replayed with its own action times, its
    critical path."""
    from autopar.runtime.execution.trace import measured_bubble, replay

    sim = replay(result.schedule, events)
    measured = measured_bubble(events)
    rows = "".join(f"<tr><td>pp rank {r}</td><td>{m:.1%}</td><td>{s:.1%}</td></tr>"
                   for r, (m, s) in enumerate(zip(measured, sim.bubble_fraction)))
    return (f'<section id="measured"><h2>Measured step</h2><p>A step as it ran: each action with its measured '
            f"time, placed by the schedule's dependencies with the step's least transfer latency (the replay of "
            f"runtime/execution/trace.py; times in seconds). The critical path is outlined.</p>"
            f'<figure id="measured-timeline">{timeline_svg(sim, title="measured step (s)", critical=True)}</figure>'
            f'<table class="figures"><tr><th></th><th>bubble measured</th><th>replayed</th></tr>{rows}</table>'
            f"{_critical_path_html(sim.critical_path, unit='s', anchor='measured-')}</section>")


def render_report(result, *, title: str | None = None, formula: bool = True, capacity: float | None = None,
                  events=None) -> str:
    """The HTML text of the report of ``result`` (an :class:`autopar.PlanResult`).

    ``formula``: add memory as a formula of microbatch size and sequence length (plans the model twice
    more, at other sizes); with ``capacity`` (bytes per device; by default the planner's cluster when it
    chose the Plan), the longest sequence and largest microbatch that fit. ``events``: a measured step
    of this plan (:func:`autopar.runtime.execution.trace.gather_events`), shown with its own critical path.
    """
    plan = result.plan
    title = title or f"autopar report: {plan.model_name} on {plan.mesh}"
    groups = graph_groups(result)
    placement = expert_placement(result, groups)  # None without expert parallelism
    sections = [
        _plan_section(result),
        _ranks_section(result, groups),
        _schedule_section(result),
        f'<section id="memory"><h2>Memory per rank</h2>{memory_html(rank_memory(result))}'
        f"{formula_html(result, capacity=capacity) if formula else ''}</section>",
        *([f'<section id="experts"><h2>Experts</h2>{experts_html(placement)}</section>'] if placement else []),
        *([_measured_section(result, events)] if events is not None else []),
        f'<section id="graphs"><h2>Rewritten graphs</h2><p>{len(groups)} distinct stage graphs: one per stage and '
        f"tensor-parallel rank. Collectives and pipeline transfers are nodes of the graph.</p>{legend_html()}"
        + "".join(graph_section(g, open_=i == 0) for i, g in enumerate(groups)) + "</section>",
        f'<section id="captured"><h2>Before</h2>{original_section(original_graph(result))}</section>',
    ]
    links = (("plan", "Plan"), ("ranks", "Ranks"), ("schedule", "Schedule"), ("memory", "Memory"),
             *((("experts", "Experts"),) if placement else ()), *((("measured", "Measured"),) if events else ()),
             ("graphs", "Graphs"), ("captured", "Before"))
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in links)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1><nav>{nav}</nav>" + "".join(sections) + "</body></html>\n")


def write_report(result, path, *, title: str | None = None, formula: bool = True,
                 capacity: float | None = None, events=None) -> Path:
    """Write :func:`render_report` of ``result`` to ``path``; returns the path."""
    path = Path(path)
    text = render_report(result, title=title, formula=formula, capacity=capacity, events=events)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot write the report to {str(path)!r}: {exc.strerror or exc}",
                        where="write_report(path) / autopar inspect --html",
                        fix="give a file path in an existing folder you can write to") from exc
    return path
