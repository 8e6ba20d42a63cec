"""A readable text diff between the captured graph and one rank's rewritten stage graphs.

Each node becomes one normalised line (:mod:`autopar.report.nodes`); the lines of the captured
graph that this stage holds are matched to the rewritten stage graph by node name (difflib), and
printed with a marker:

- ``+`` a node the compiler inserted: collectives (with what they communicate), sends, receives,
  the replacement ops of a sharded layer;
- ``-`` a node of this stage that the rewrite removed or replaced;
- ``~`` a node kept but changed: a parameter's shard shape, a view's sizes divided by tp, an op
  that now reads a collective's output;
- ``···`` runs of unchanged nodes, folded.

Nodes that run on the rank's other stages are not listed one by one: a closing section counts
them per stage and pipeline unit.

    >>> import autopar
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), f, y = gpt_tiny()
    >>> result = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=(x,), loss_fn=f, example_target=y)
    >>> text = graph_diff(result, rank=1)       # or: autopar inspect ... --diff --rank 1
    >>> print(text.splitlines()[0])
    rank 1 (dp=0 pp=0 tp=1) against the captured graph (84 nodes, one device)
"""
from __future__ import annotations

from collections import Counter

import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.report.collect import original_graph, stage_graphs
from autopar.report.nodes import NodeView, describe_node, walk

__all__ = ["graph_diff", "stage_of_nodes"]

def _views(gm: fx.GraphModule) -> list[NodeView]:
    return [describe_node(owner, node) for node, owner, _depth in walk(gm)]


def _units(gm: fx.GraphModule) -> dict[str, str]:
    """{node name: pipeline unit (``blocks.3``, ``lm_head``…)} of the captured graph."""
    out = {}
    for node in gm.graph.nodes:
        info = get_meta(node, MODULE)
        unit = info.unit if info is not None else {"get_attr": "parameters", "placeholder": "inputs"}.get(
            node.op, node.op)
        unit = unit[len("model."):] if unit.startswith("model.") else unit
        out[node.name] = {"": "loss_fn", "model": "model (top level)"}.get(unit, unit)
    return out


def stage_of_nodes(original: list[NodeView], graphs: dict[int, fx.GraphModule]) -> dict[str, set[int]]:
    """{captured node name: stages holding it}. A node no stage kept (a rewrite replaced it) belongs to
    the stage of the next compute node that was kept, or of the last one before it."""
    where: dict[str, set[int]] = {}
    for stage, gm in graphs.items():
        for node, _owner, _depth in walk(gm):
            where.setdefault(node.name, set()).add(stage)
    located = {v.name: where[v.name] for v in original if v.name in where}
    anchors = [i for i, v in enumerate(original) if v.name in located and v.kind == "compute"]
    out = {}
    for i, v in enumerate(original):
        if v.name in located:
            out[v.name] = located[v.name]
            continue
        after = [j for j in anchors if j > i]
        before = [j for j in anchors if j < i]
        pick = after[0] if after else (before[-1] if before else None)
        out[v.name] = set(located[original[pick].name]) if pick is not None else set(graphs)
    return out


def _shape(shape) -> str:
    return "-" if shape is None else "(" + ", ".join(str(d) for d in shape) + ")"


def _line(mark: str, v: NodeView, width: int = 80) -> str:
    tail = _shape(v.shape) + (f"  {v.placement}" if v.placement else "")
    text = f"{mark} {v.line}"
    if v.comm:
        tail += f"  [{v.comm}]"
    return f"{text:<{width}} {tail}" if len(text) < width else f"{text}\n{'':<{width}} {tail}"


def _changed(old: NodeView, new: NodeView) -> str | None:
    """The ``~`` entry for a node whose code or shape changed (None when it did not)."""
    same_shape = old.shape == new.shape or old.kind == "output"  # a stage's output is a send token
    if old.line == new.line and same_shape:
        return None
    out = [f"~ {old.line}" if old.line == new.line else f"~ {old.line}\n      now {new.line.split(' = ', 1)[-1]}"]
    if not same_shape:
        placed = f"   placement {new.placement}" if new.placement else ""
        out.append(f"      shape {_shape(old.shape)} -> {_shape(new.shape)}{placed}")
    return "\n".join(out)


def _entries(a: list[NodeView], b: list[NodeView]) -> list[tuple[str, str]]:
    """(tag, text) per node in the rewritten graph's order: ' ' unchanged, '+', '-', '~'.

    Nodes are paired by name, wherever the rewrite moved them (stage graphs read each parameter
    just before its first use). A removed node is shown just before the nodes inserted in front
    of the next captured node that survived: where its replacement is.
    """
    old = {v.name: v for v in a}
    new_names = {v.name for v in b}
    removed_before: dict[str, list[NodeView]] = {}
    pending: list[NodeView] = []
    for v in a:
        if v.name in new_names:
            if pending:
                removed_before.setdefault(v.name, []).extend(pending)
                pending = []
        else:
            pending.append(v)
    position = {v.name: i for i, v in enumerate(b)}
    slots: dict[int, list[NodeView]] = {}
    for name, gone in removed_before.items():
        i = position[name]
        while i > 0 and (b[i - 1].name not in old or b[i - 1].kind == "param"):  # back over inserted nodes
            i -= 1
        slots.setdefault(i, []).extend(gone)
    slots.setdefault(len(b), []).extend(pending)
    out: list[tuple[str, str]] = []
    for i, v in enumerate(b + [None]):
        out.extend(("-", _line("-", g)) for g in slots.get(i, ()))
        if v is None:
            break
        if v.name not in old:
            out.append(("+", _line("+", v)))
            continue
        change = _changed(old[v.name], v)
        out.append(("~", change) if change else (" ", _line(" ", v)))
    return out


def _fold(entries: list[tuple[str, str]], context: int) -> list[str]:
    """Fold runs of unchanged nodes, keeping ``context`` of them next to each change."""
    lines, i = [], 0
    while i < len(entries):
        if entries[i][0] != " ":
            lines.append(entries[i][1])
            i += 1
            continue
        j = i
        while j < len(entries) and entries[j][0] == " ":
            j += 1
        head = context if i > 0 else 0
        tail = context if j < len(entries) else 0
        run = [text for _tag, text in entries[i:j]]
        if len(run) <= head + tail + 1:
            lines.extend(run)
        else:
            lines.extend(run[:head])
            lines.append(f"  ··· {len(run) - head - tail} unchanged nodes")
            lines.extend(run[len(run) - tail:])
        i = j
    return lines


def _counts(entries, b: list[NodeView]) -> str:
    inserted = Counter(v.op for v in b if v.kind == "collective")
    tags = Counter(tag for tag, _text in entries)
    kinds = Counter(v.kind for v in b if v.kind in ("send", "recv", "region"))
    colls = ", ".join(f"{op} x{n}" for op, n in sorted(inserted.items()))
    parts = [f"{sum(inserted.values())} collectives" + (f" ({colls})" if colls else ""),
             f"{kinds['send']} send", f"{kinds['recv']} recv"]
    if kinds["region"]:
        parts.append(f"{kinds['region']} recompute regions")
    return (f"  {tags['+']} node{'s' if tags['+'] != 1 else ''} inserted: " + ", ".join(parts)
            + f"; {tags['-']} removed or replaced; {tags['~']} changed (shard shapes, view sizes, inputs)")


def _elsewhere(original: list[NodeView], where: dict, stages: list[int], units: dict, owner) -> list[str]:
    """Per other stage: how many captured nodes run there, by pipeline unit."""
    lines = []
    for stage in sorted({s for held in where.values() for s in held} - set(stages)):
        names = [v.name for v in original if stage in where[v.name] and not where[v.name] & set(stages)]
        by_unit = Counter(units.get(n, "?") for n in names)
        listed = ", ".join(f"{u} ({k})" for u, k in by_unit.most_common())
        lines.append(f"  stage {stage} (pp rank {owner[stage]}): {len(names)} nodes of {listed}")
    return lines


def graph_diff(result, rank: int, *, stage: int | None = None, context: int = 1) -> str:
    """The captured graph against rank ``rank``'s rewritten stage graphs (or its ``stage``), as text."""
    program = result.rank_program(rank)
    mine = [s for s in program.stages if stage is None or s.stage == stage]
    if not mine:
        held = [s.stage for s in program.stages]
        raise PlanError(f"rank {rank} does not run stage {stage}", where="graph_diff(stage=...)",
                        fix=f"pick one of its stages {held} or leave stage out")
    captured = original_graph(result)
    original = _views(captured)
    graphs = {s: g.gm for s, g in stage_graphs(result, tp=program.coords["tp"],
                                                  cp=program.coords.get("cp", 0)).items()}
    where = stage_of_nodes(original, graphs)
    c = program.coords
    out = [f"rank {rank} (" + " ".join(f"{axis}={value}" for axis, value in c.items()) + ") against the captured graph "
           f"({len(original)} nodes, one device)"]
    for s in mine:
        a = [v for v in original if s.stage in where[v.name]]
        b = _views(s.gm)
        entries = _entries(a, b)
        out += ["", f"--- captured graph, the {len(a)} nodes that stage {s.stage} holds",
                f"+++ rank {rank}, stage {s.stage}: {len(b)} nodes", _counts(entries, b), ""]
        out += _fold(entries, context)
    others = _elsewhere(original, where, [s.stage for s in mine], _units(captured), result.schedule.stage_to_rank)
    if others:
        out += ["", "nodes on other stages (not listed one by one):"] + others
    return "\n".join(out)
