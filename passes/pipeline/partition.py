"""Cost-balanced pipeline partitioning: assign every node to a stage.

The graph is read as a sequence of *segments* (maximal runs of nodes of one pipeline unit: a
block of a ModuleList such as ``model.blocks.3``, or a top-level child such as ``model.lm_head``).
Stages are cut only where a block begins (or right after the last block), and the cuts minimise
the largest stage cost (forward FLOPs, plus a small per-node term) by dynamic programming, so
heavy first and last stages (embedding, LM head and loss) get fewer blocks.

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> from autopar.passes.frontend.annotate import annotate
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> gm, starts = cut_stages(gm, num_stages=2)
    >>> starts            # the unit each stage after the first begins with
    ['model.blocks.1']

The lowering's analysis pass :func:`assign_stages` cuts the graph into the Plan's stages (at the Plan's
stage starts when it names them); the planner's profiler cuts it at every place a stage may begin.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir.graph_names import MODEL_PREFIX
from autopar.ir.meta_keys import COST, MODULE, STAGE, StageInfo, get_meta, set_meta
from autopar.passes.lowering_state import LoweringState

__all__ = ["Segment", "pipeline_segments", "balanced_cuts", "cut_stages", "assign_stages"]

_BLOCK = re.compile(r"\.\d+$")
_NODE_COST = 1.0  # per-node term so FLOP-free segments still weigh something


@dataclass
class Segment:
    """A maximal run of call nodes of one unit, with its cost."""

    unit: str
    nodes: list[fx.Node] = field(default_factory=list)
    cost: float = 0.0

    @property
    def is_block(self) -> bool:
        return bool(_BLOCK.search(self.unit))


def pipeline_segments(gm: fx.GraphModule) -> list[Segment]:
    """The graph's call nodes grouped into segments in graph order."""
    segments: list[Segment] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module", "call_method"):
            continue
        info = get_meta(node, MODULE)
        unit = info.unit if info else ""
        if not segments or segments[-1].unit != unit:
            segments.append(Segment(unit))
        cost = get_meta(node, COST)
        segments[-1].nodes.append(node)
        segments[-1].cost += (cost.flops if cost else 0) + _NODE_COST
    return _merge_sandwiched(segments)


def _merge_sandwiched(segments: list[Segment]) -> list[Segment]:
    """Fold [block A][other][block A] into one segment of A.

    symbolic_trace records module paths only for leaf modules, so a block's views, attention and
    residual adds come back as root-level code between its linears; a stage must not begin there.
    """
    merged: list[Segment] = []
    for segment in segments:
        if (len(merged) >= 2 and merged[-2].is_block and merged[-2].unit == segment.unit
                and not merged[-1].is_block):
            middle = merged.pop()
            merged[-1].nodes += middle.nodes + segment.nodes
            merged[-1].cost += middle.cost + segment.cost
        elif merged and merged[-1].unit == segment.unit:
            merged[-1].nodes += segment.nodes
            merged[-1].cost += segment.cost
        else:
            merged.append(segment)
    return merged


def _allowed_starts(segments: list[Segment]) -> list[int]:
    """Segment indices a stage may begin at: a block's start, or just after the last block."""
    blocks = [i for i, s in enumerate(segments) if s.is_block]
    if not blocks:
        return list(range(1, len(segments)))
    allowed = {i for i in blocks if i > 0 and segments[i - 1].unit != segments[i].unit}
    if blocks[-1] + 1 < len(segments):
        allowed.add(blocks[-1] + 1)
    return sorted(allowed)


def balanced_cuts(costs: list[float], num_stages: int, allowed: list[int]) -> list[int]:
    """Stage start indices (len num_stages-1, from ``allowed``) minimising the largest stage cost."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    starts = [0] + [a for a in allowed if 0 < a < n]
    best = {(0, 0): (0.0, [])}  # (stages used, start index of next stage) -> (max cost, cuts)
    for k in range(1, num_stages + 1):
        ends = starts[1:] + [n] if k < num_stages else [n]
        for end in ends:
            candidates = [(max(prev_max, prefix[end] - prefix[begin]), cuts + ([end] if end < n else []))
                          for (used, begin), (prev_max, cuts) in best.items()
                          if used == k - 1 and begin < end]
            if candidates:
                best[(k, end)] = min(candidates, key=lambda c: c[0])
    if (num_stages, n) not in best:
        most = len(starts)  # every stage begins at one of these
        raise PlanError(
            f"the model splits into at most {most} pipeline stages (a stage begins at a block or right "
            f"after the last block), not {num_stages}",
            where="pipeline partitioning: stages = mesh dim 'pp' x num_virtual",
            fix=f"lower 'pp' (or num_virtual) so that pp x num_virtual <= {most}, or give the model more blocks")
    return best[(num_stages, n)][1]


def assign_stages(st: LoweringState) -> LoweringState:
    """An analysis pass: ``autopar.stage`` on every call node of ``st.gm`` for the Plan's stages (cut where the
    Plan's stage starts say, else balanced); ``starts``: the unit each stage after the first begins at."""
    starts = st.plan.pipeline.stage_starts
    gm, cuts = cut_stages(st.gm, num_stages=st.num_stages,
                          stage_starts=[MODEL_PREFIX + "." + s for s in starts] if starts else None)
    return dataclasses.replace(st, gm=gm, starts=tuple(cuts))


def cut_stages(gm: fx.GraphModule, *, num_stages: int, stage_starts: list[str] | None = None):
    """Write ``autopar.stage`` on every call node; returns (gm, the unit each later stage starts at)."""
    segments = pipeline_segments(gm)
    allowed = _allowed_starts(segments)
    if stage_starts is None:
        cuts = balanced_cuts([s.cost for s in segments], num_stages, allowed) if num_stages > 1 else []
    else:
        cuts = _cuts_from_names(segments, allowed, stage_starts, num_stages)
    stage = 0
    for i, segment in enumerate(segments):
        if stage < len(cuts) and i == cuts[stage]:
            stage += 1
        for node in segment.nodes:
            set_meta(node, STAGE, StageInfo(stage))
    return gm, [segments[c].unit for c in cuts]


def _cuts_from_names(segments, allowed, names, num_stages) -> list[int]:
    if len(names) != num_stages - 1:
        raise PlanError(f"the plan names {len(names)} stage starts for {num_stages} stages",
                        where="Plan.pipeline.stage_starts", fix=f"give exactly {num_stages - 1} unit names")
    by_unit = {segments[i].unit: i for i in reversed(allowed)}
    missing = [n for n in names if n not in by_unit]
    if missing:  # shown as the Plan names them: module paths of the user's model, without the prefix
        raise PlanError(f"stage starts {[_plan_name(n) for n in missing]} are not places the model can be cut",
                        where="Plan.pipeline.stage_starts",
                        fix=f"use units from {[_plan_name(segments[i].unit) for i in allowed][:12]}")
    cuts = [by_unit[n] for n in names]
    if cuts != sorted(set(cuts)):
        raise PlanError("stage starts are not in model order", where="Plan.pipeline.stage_starts",
                        fix="list them in the order the model runs them")
    return cuts


def _plan_name(unit: str) -> str:
    """A unit as Plan.pipeline.stage_starts spells it (``model.blocks.3`` -> ``blocks.3``)."""
    prefix = MODEL_PREFIX + "."
    return unit[len(prefix):] if unit.startswith(prefix) else unit
