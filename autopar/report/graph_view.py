"""One rewritten graph as HTML: a coloured strip of its nodes, counts, and a table of every node.

Each node is a row: its name, its normalised code (``linear = aten.linear(tp_copy_0, ...)``), its
shape (``autopar.tensor``), its tensor-parallel placement (``autopar.tp_placement``) and its module
path. Rows are tinted by placement (sharded blue, partial-sum amber) and edged in their stage's
colour; collectives are red with a badge naming what they communicate, sends and receives purple.
"""
from __future__ import annotations

from collections import Counter
from html import escape

import torch.fx as fx

from autopar.report.collect import GraphGroup
from autopar.report.nodes import NodeView, describe_node, walk

__all__ = ["stage_color", "graph_section", "original_section", "node_rows", "graph_stats", "legend_html",
           "STAGE_COLORS"]

STAGE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_STRIP = {"collective": "#d62728", "send": "#7b3fb5", "recv": "#7b3fb5", "param": "#b0b0b0",
          "input": "#333333", "output": "#333333", "region": "#e0a800"}
_PLACEMENT_STRIP = {"S": "#6fa8dc", "P": "#f6b26b", "R": "#d0d0d0"}


def stage_color(stage: int | None) -> str:
    """The colour of ``stage`` (grey when unknown)."""
    return "#999999" if stage is None else STAGE_COLORS[stage % len(STAGE_COLORS)]


def _views(gm: fx.GraphModule) -> list[tuple[NodeView, int]]:
    return [(describe_node(owner, node), depth) for node, owner, depth in walk(gm)]


def graph_stats(views) -> dict:
    """Counts of one graph's nodes: collectives by type, sends, recvs, parameters, regions."""
    kinds = Counter(v.kind for v, _d in views)
    return {"nodes": len(views), "collectives": Counter(v.op for v, _d in views if v.kind == "collective"),
            "send": kinds["send"], "recv": kinds["recv"], "param": kinds["param"], "region": kinds["region"]}


def _strip_svg(views, *, width: int = 900, height: int = 18) -> str:
    """A thin picture of the graph: one cell per node, coloured by kind, then by placement."""
    n = max(len(views), 1)
    cells = []
    for i, (v, _d) in enumerate(views):
        color = _STRIP.get(v.kind) or _PLACEMENT_STRIP.get(v.placement[:1], "#ececec")
        tall = v.kind in ("collective", "send", "recv")
        y, h = (0, height) if tall else (4, height - 8)
        cells.append(f'<rect x="{i}" y="{y}" width="1" height="{h}" fill="{color}"><title>{escape(v.name)}'
                     f"</title></rect>")
    return (f'<svg class="strip" width="{width}" height="{height}" viewBox="0 0 {n} {height}" '
            f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">{"".join(cells)}</svg>')


def _shape(v: NodeView) -> str:
    if v.shape is None:
        return ""
    return "(" + ", ".join(str(d) for d in v.shape) + ")" + (f" {v.dtype}" if v.dtype not in ("", "float32") else "")


def node_rows(views) -> str:
    """The ``<tr>`` rows of a node table."""
    rows = []
    for v, depth in views:
        badge = ""
        if v.kind == "collective":
            badge = f'<span class="badge coll" title="{escape(v.comm)}">&#8644; {escape(v.comm)}</span> '
        elif v.kind in ("send", "recv"):
            arrow = "&#8594;" if v.kind == "send" else "&#8592;"
            badge = f'<span class="badge p2p">{arrow} {escape(v.comm)}</span> '
        elif v.kind == "region":
            badge = f'<span class="badge region">{escape(v.comm)}</span> '
        code = escape(v.line.split(" = ", 1)[1] if " = " in v.line else v.line)
        placement = v.placement[:1] or "none"
        indent = f' style="padding-left:{6 + 16 * depth}px"' if depth else ""
        rows.append(f'<tr class="n k-{v.kind} pl-{placement}" style="border-left:5px solid {stage_color(v.stage)}">'
                    f"<td{indent}>{escape(v.name)}</td><td>{badge}<code>{code}</code></td>"
                    f"<td>{_shape(v)}</td><td>{escape(v.placement)}</td><td>{escape(v.module)}</td></tr>")
    return "".join(rows)


def _table(views) -> str:
    return ('<table class="nodes"><tr><th>node</th><th>code</th><th>shape</th><th>placement</th>'
            "<th>module</th></tr>" + node_rows(views) + "</table>")


def _stats_line(stats: dict) -> str:
    colls = ", ".join(f"{op} &#215;{n}" for op, n in sorted(stats["collectives"].items())) or "none"
    total = sum(stats["collectives"].values())
    region = f", {stats['region']} recompute regions" if stats["region"] else ""
    return (f'{stats["nodes"]} nodes: <span class="count-coll">{total} collectives</span> ({colls}), '
            f'<span class="count-p2p">{stats["send"]} send, {stats["recv"]} recv</span>, '
            f"{stats['param']} parameters{region}")


def graph_section(group: GraphGroup, *, open_: bool = False) -> str:
    """The ``<section class="graph">`` of one stage graph and the ranks that run it."""
    views = _views(group.graph.gm)
    stats = graph_stats(views)
    g = group.graph
    ranks = ", ".join(f'<a href="#rank-{r}">{r}</a>' for r in group.ranks)
    who = f"; cp rank {group.cp} of {group.cp_size}: its own positions of each sequence" if group.cp_size > 1 else ""
    edges = "; ".join([f"receives {e.value} from stage {e.src}" for e in g.recvs]
                      + [f"sends {e.value} to stage {e.dst}" for e in g.sends]) or "no pipeline edges"
    return (f'<section class="graph" id="{group.anchor}" data-stage="{group.stage}" data-tp="{group.tp}" '
            f'data-cp="{group.cp}" '
            f'style="border-left:6px solid {stage_color(group.stage)}">'
            f"<h3>Stage {group.stage} &#183; tp rank {group.tp}"
            + (f" &#183; cp rank {group.cp}" if group.cp_size > 1 else "") + "</h3>"
            f'<p class="who">pp rank {group.pp}; run by rank{"s" if len(group.ranks) > 1 else ""} {ranks} '
            f"(one per dp replica{who}). Inputs: {escape(', '.join(g.input_names) or 'none')}; "
            f"{escape(edges)}.</p>"
            f'<p class="stats">{_stats_line(stats)}</p>{_strip_svg(views)}'
            f'<details{" open" if open_ else ""}><summary>the {stats["nodes"]} nodes</summary>'
            f"{_table(views)}</details></section>")


def original_section(gm: fx.GraphModule) -> str:
    """The captured graph before any transform, collapsed."""
    views = _views(gm)
    return (f'<section class="original-graph" id="original"><h3>The captured graph, before any transform</h3>'
            f'<p class="stats">{len(views)} nodes, one device, shapes at microbatch size.</p>{_strip_svg(views)}'
            f"<details><summary>the {len(views)} nodes</summary>{_table(views)}</details></section>")


def legend_html() -> str:
    """The key to the colours of the node tables and strips."""
    items = [("pl-S", "sharded (S)"), ("pl-P", "partial sum (P)"), ("k-collective", "collective"),
             ("k-send", "send / recv"), ("k-param", "parameter")]
    keys = "".join(f'<span class="legend-item {cls}">{text}</span>' for cls, text in items)
    stages = "".join(f'<span class="legend-item" style="border-left:5px solid {c}">stage {i}</span>'
                     for i, c in enumerate(STAGE_COLORS[:4]))
    return f'<div class="legend">{keys} {stages} &#8230;</div>'
