"""A module that computes each position from that position alone, verified by running it on probes.

Mixture-of-experts layers route tokens by sorting, gathering and scattering rows, which no per-op
sequence rule can follow; yet each token's output depends only on its own input row, whatever the
family writes (a grouped matmul over sorted rows, a loop over experts, group-limited routing). When the
sequence analysis meets an op it must refuse, it asks whether an enclosing module is such a *row-wise*
unit: the module's nodes (by module path) read one sequence-sharded value ``x`` and otherwise only
weights and constants, and give back values shaped like ``x``. The module's subgraph is then run on a
random ``x`` and again with one position changed: if only that position of each output changes (and
every other stays within 1e-6 relative), the whole module follows the shard.

Dropless routing is what passes: with a capacity factor a token may be dropped because of other tokens,
and the probe sees other positions change.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.frontend.annotate import module_path_of
from autopar.passes.context_parallel.graph_util import ancestors, shape, value
from autopar.passes.context_parallel.seq_place import Place

__all__ = ["Unit", "find_unit"]


class Unit:
    """A row-wise module: its path, its nodes, the input it reads and the outputs it gives back."""

    def __init__(self, path: str, nodes: list, x: fx.Node, outputs: list):
        self.path, self.nodes, self.x, self.outputs = path, nodes, x, outputs


def _region(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and
            (module_path_of(n) == path or module_path_of(n).startswith(path + "."))]


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], x: fx.Node, outputs: list[fx.Node], consts: set):
    """The region and the constants it reads (``consts``: weights and what is computed from them alone) as a
    GraphModule of ``x``, returning ``outputs``."""
    inside = set(nodes)
    graph, env = fx.Graph(), {}
    env[x] = graph.placeholder("x")
    for node in gm.graph.nodes:
        if node in inside or node in consts:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph)


def _changed_only_at(base, moved, place: Place, position: int) -> bool:
    for a, b in zip(base, moved):
        shp = (*a.shape[:place.dim], place.outer, place.size, place.inner, *a.shape[place.dim + 1:])
        diff = (a - b).abs().reshape(shp)
        scale = a.abs().max().clamp_min(1e-12)
        others = torch.cat([diff.narrow(place.dim + 1, 0, position),
                            diff.narrow(place.dim + 1, position + 1, place.size - position - 1)], dim=place.dim + 1)
        if others.numel() and float(others.max()) > 1e-6 * float(scale):
            return False
        if float(diff.narrow(place.dim + 1, position, 1).max()) == 0.0:
            return False  # the position's own output did not move: the probe proves nothing
    return True


def _probe(sub: fx.GraphModule, x: fx.Node, place: Place) -> bool:
    val = value(x)
    g = torch.Generator().manual_seed(0)
    base_in = torch.randn(tuple(val.shape), generator=g).to(val.dtype)
    with torch.no_grad():
        base = sub(base_in)
        for position in sorted({0, place.size // 2, place.size - 1}):
            moved_in = base_in.clone().reshape(*base_in.shape[:place.dim], place.outer, place.size, place.inner,
                                               *base_in.shape[place.dim + 1:])
            moved_in.select(place.dim + 1, position).add_(torch.randn(
                moved_in.select(place.dim + 1, position).shape, generator=g).to(val.dtype))
            if not _changed_only_at(base, sub(moved_in.reshape(base_in.shape)), place, position):
                return False
    return True


def _unit_of(gm: fx.GraphModule, path: str, places: dict) -> Unit | None:
    """The part of module ``path`` that makes its outputs shaped like its one sequence-sharded input, when
    it is row-wise; other outputs (a router's statistics) are left to the per-op rules."""
    region = _region(gm, path)
    inside = set(region)
    outside = [n for n in region if any(u not in inside for u in n.users)]
    candidates = {a for n in region for a in n.all_input_nodes if a not in inside and a in places}
    if len(candidates) != 1:
        return None
    x = next(iter(candidates))
    outputs = [n for n in outside if shape(n) == shape(x)]
    nodes = [n for n in region if n in ancestors(outputs)] if outputs else []
    unit = set(nodes)
    reads = {a for n in nodes for a in n.all_input_nodes if a not in unit}
    consts = ancestors(list(reads - {x}))
    leaking = [n for n in nodes if n not in outputs and n not in places and any(u not in unit for u in n.users)]
    if not nodes or x not in reads or x in consts or any(a.op == "placeholder" for a in consts) or leaking \
            or not isinstance(value(x), torch.Tensor):
        return None
    try:
        ok = _probe(_subgraph(gm, nodes, x, outputs, consts), x, places[x])
    except Exception:  # noqa: BLE001 - a meta weight, an op that cannot run here: not proven row-wise
        ok = False
    return Unit(path, nodes, x, outputs) if ok else None


def find_unit(gm: fx.GraphModule, node: fx.Node, places: dict) -> Unit | None:
    """The innermost module enclosing ``node`` that holds a row-wise unit around it (module doc), or None."""
    parts = module_path_of(node).split(".")
    for depth in range(len(parts), 0, -1):
        unit = _unit_of(gm, ".".join(parts[:depth]), places)
        if unit is not None and node in unit.nodes:
            return unit
    return None
