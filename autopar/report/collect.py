"""What the report and the diff read from a :class:`autopar.PlanResult`: graphs grouped by who runs them.

Ranks that share ``(cp, pp, tp)`` coordinates run the same stage graphs (dp replicas differ only in
their data), so each distinct graph is shown once, as a :class:`GraphGroup` that lists its ranks. Ranks
of one dp replica that differ in cp run different graphs (each its own positions of the sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir.meta_keys import COST, get_meta
from autopar.ir.stage_graph import StageGraph
from autopar.planning import rank_of
from autopar.report.nodes import walk

__all__ = ["GraphGroup", "graph_groups", "stage_graphs", "stage_flops", "original_graph"]


@dataclass(frozen=True)
class GraphGroup:
    """One rewritten stage graph and every rank that runs it."""

    stage: int
    tp: int
    pp: int
    graph: StageGraph
    ranks: tuple[int, ...]
    cp: int = 0  # the cp rank (context parallelism: each cp rank's graph holds its own positions)
    cp_size: int = 1

    @property
    def anchor(self) -> str:
        """The HTML id of this graph's section."""
        return f"graph-s{self.stage}-t{self.tp}" + (f"-c{self.cp}" if self.cp_size > 1 else "")


def stage_graphs(result, *, tp: int, cp: int = 0) -> dict[int, StageGraph]:
    """{stage: StageGraph} of tensor-parallel rank ``tp`` and cp rank ``cp``, every stage (built on demand)."""
    shape = result.plan.mesh
    out: dict[int, StageGraph] = {}
    for pp in range(shape.pp):
        for s in result.rank_program(rank_of(dp=0, cp=cp, pp=pp, tp=tp, shape=shape)).stages:
            out.setdefault(s.stage, s)
    return dict(sorted(out.items()))


def graph_groups(result) -> list[GraphGroup]:
    """Every distinct stage graph of the plan, ordered by stage, tp rank and cp rank, with the ranks that run it."""
    shape = result.plan.mesh
    groups = []
    for tp in range(shape.tp):
        for cp in range(shape.cp):
            for stage, graph in stage_graphs(result, tp=tp, cp=cp).items():
                pp = result.schedule.stage_to_rank[stage]
                ranks = tuple(rank_of(dp=d, cp=cp, pp=pp, tp=tp, shape=shape) for d in range(shape.dp))
                groups.append(GraphGroup(stage=stage, tp=tp, pp=pp, graph=graph, ranks=ranks, cp=cp,
                                         cp_size=shape.cp))
    return sorted(groups, key=lambda g: (g.stage, g.tp, g.cp))


def stage_flops(gm: fx.GraphModule) -> int:
    """Forward FLOPs of a stage graph (``autopar.cost`` summed, recompute regions included)."""
    total = 0
    for node, _gm, _depth in walk(gm):
        cost = get_meta(node, COST)
        total += cost.flops if cost is not None else 0
    return total


def original_graph(result) -> fx.GraphModule:
    """The captured, annotated graph of the whole model before any transform."""
    captured = getattr(result, "captured", None)
    if captured is None or getattr(captured, "captured", None) is None:
        raise PlanError("this PlanResult holds no captured graph", where="autopar.report",
                        fix="pass the result of autopar.plan(...) itself")
    return captured.captured.gm
