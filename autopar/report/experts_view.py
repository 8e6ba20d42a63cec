"""Expert parallelism in the report: which rank holds which experts, and where tokens move.

Everything is read off the rewritten graphs: each ``MoeDispatch`` / ``MoeCombine`` node carries
``autopar.moe_exchange`` (:class:`~autopar.ir.meta_keys.MoeExchange`, written by
:mod:`autopar.passes.moe.moe_expert_parallel`): its layer, the ep size, every ep rank's expert range and
the capacity factor. Which dp indices form an ep group (and an edp group, the ranks holding the same
experts) is the rule every part reads, :class:`autopar.parallel_dims.ParallelDims`; the capacity is the
dispatch module's own :meth:`~autopar.ops.moe_ops.MoeDispatch.capacity` of the rows its input holds.

:func:`expert_placement` collects the facts; :func:`experts_html` draws them as two tables (ranks x
layers with the expert ranges and groups; per layer and rank, the all-to-all nodes and their group).
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape

from autopar.ir.graph_names import user_name
from autopar.ir.meta_keys import MOE_EXCHANGE, TENSOR, get_meta
from autopar.parallel_dims import ParallelDims
from autopar.report.nodes import walk

__all__ = ["ExchangeNode", "RankExperts", "ExpertPlacement", "expert_placement", "experts_html"]


@dataclass(frozen=True)
class ExchangeNode:
    """One dispatch or combine node of a stage graph (the graph's section anchor, the node, its meta)."""

    anchor: str
    stage: int
    tp: int
    pp: int
    node: str
    role: str
    layer: str
    ep: int
    experts: tuple[tuple[int, int], ...]
    capacity_factor: float | None
    rows: int | None  # rows entering the dispatch per microbatch (its input's shape), None for a combine
    capacity: int | None  # rows each expert takes from one rank (None: dropless)


@dataclass(frozen=True)
class RankExperts:
    """One rank: its ep index, its ep and edp groups (global ranks) and ``{layer: (first, end)}``."""

    rank: int
    coords: dict
    ep_rank: int
    ep_group: tuple[int, ...]
    edp_group: tuple[int, ...]
    experts: dict


@dataclass(frozen=True)
class ExpertPlacement:
    layers: tuple[str, ...]  # every MoE layer, in stage then graph order
    ranks: tuple[RankExperts, ...]
    nodes: tuple[ExchangeNode, ...]


def _nodes(group) -> list[ExchangeNode]:
    gm = group.graph.gm
    out = []
    for node, owner, _depth in walk(gm):  # (recompute regions included)
        info = get_meta(node, MOE_EXCHANGE)
        if info is None:
            continue
        rows = capacity = None
        if info.role == "dispatch":
            shape = getattr(get_meta(node.args[0], TENSOR), "shape", None) if node.args else None
            rows = shape[0] if shape else None
            if rows is not None:
                capacity = owner.get_submodule(node.target).capacity(rows)
        out.append(ExchangeNode(anchor=group.anchor, stage=group.stage, tp=group.tp, pp=group.pp, node=node.name,
                                role=info.role, layer=user_name(info.layer), ep=info.ep, experts=info.experts,
                                capacity_factor=info.capacity_factor, rows=rows, capacity=capacity))
    return out


def expert_placement(result, groups) -> ExpertPlacement | None:
    """The placement of every MoE layer's experts over the ranks, or None without expert parallelism."""
    nodes = [n for g in groups for n in _nodes(g)]
    if not nodes:
        return None
    dims = ParallelDims.of(result.plan.mesh, ep=nodes[0].ep)
    layers = tuple(dict.fromkeys(n.layer for n in nodes))
    ranges = {(n.pp, n.tp, n.layer): n.experts for n in nodes if n.role == "dispatch"}
    ranks = []
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        j = dims.index("ep", c)
        held = {layer: r[j] for layer in layers if (r := ranges.get((c["pp"], c["tp"], layer)))}
        ranks.append(RankExperts(rank=rank, coords=c, ep_rank=j, ep_group=tuple(dims.axis_ranks("ep", rank)),
                                 edp_group=tuple(dims.axis_ranks("edp", rank)), experts=held))
    return ExpertPlacement(layers=layers, ranks=tuple(ranks), nodes=tuple(nodes))


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _experts(span) -> str:
    first, end = span
    return f"{first}" if end - first == 1 else f"{first}&#8211;{end - 1}"


def _placement_table(p: ExpertPlacement) -> str:
    head = "".join(f"<th>{escape(layer)}</th>" for layer in p.layers)
    rows = []
    for r in p.ranks:
        cells = "".join(f'<td class="experts">{_experts(r.experts[layer])}</td>' if layer in r.experts
                        else '<td class="experts">&#8212;</td>' for layer in p.layers)
        rows.append(f'<tr class="expert-row" id="experts-rank-{r.rank}"><td>rank {r.rank}</td><td>{r.coords["dp"]}'
                    f"</td><td>{r.coords['pp']}</td><td>{r.coords['tp']}</td><td>{r.ep_rank}</td>"
                    f"<td>{_ranks(r.ep_group)}</td><td>{_ranks(r.edp_group)}</td>{cells}</tr>")
    return ('<table class="placement"><tr><th>rank</th><th>dp</th><th>pp</th><th>tp</th><th>ep rank</th>'
            f"<th>ep group (ranks)</th><th>edp group (ranks)</th>{head}</tr>" + "".join(rows) + "</table>")


def _movement_table(p: ExpertPlacement) -> str:
    by_graph: dict = {}
    for n in p.nodes:
        by_graph.setdefault((n.pp, n.tp, n.layer), []).append(n)
    rows = []
    for layer in p.layers:
        for r in p.ranks:
            mine = by_graph.get((r.coords["pp"], r.coords["tp"], layer))
            if not mine:
                continue
            links = " ".join(f'<a href="#{n.anchor}"><code class="exchange {n.role}">{escape(n.node)}</code></a>'
                             for n in mine)
            dispatch = next((n for n in mine if n.role == "dispatch"), None)
            if dispatch is None or dispatch.capacity is None:
                cap = "dropless: every routed row reaches its expert"
            else:
                cap = (f"capacity factor {dispatch.capacity_factor:g}: at most {dispatch.capacity} of its "
                       f"{dispatch.rows} rows to each expert")
            rows.append(f'<tr class="exchange-row"><td>{escape(layer)}</td><td>rank {r.rank}</td>'
                        f"<td>stage {mine[0].stage}</td><td>{links}</td><td>all_to_all over ep: ranks "
                        f"{_ranks(r.ep_group)}</td><td>{escape(cap)}</td></tr>")
    return ('<table class="movement"><tr><th>layer</th><th>rank</th><th>stage</th><th>nodes (forward; backward: '
            "their conjugates)</th><th>group</th><th>rows</th></tr>" + "".join(rows) + "</table>")


def experts_html(p: ExpertPlacement) -> str:
    """The section's body: the placement table and the token movement table."""
    ep = p.nodes[0].ep
    return (f"<p>Each MoE layer's experts are split over ep={ep} ranks carved out of dp: the table gives the "
            f"experts each rank holds per layer (its ep group exchanges tokens; its edp group holds the same "
            f"experts and averages their gradients).</p>{_placement_table(p)}"
            f"<h3>Where tokens move</h3><p>Per layer and rank: the dispatch sends each routed row to its "
            f"expert's rank, the combine sends the expert outputs back; in backward each runs the conjugate "
            f"all-to-all.</p>{_movement_table(p)}")
