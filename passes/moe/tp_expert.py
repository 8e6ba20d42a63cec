"""Expert tensor parallelism: every expert's MLP column- and row-sharded over tp.

For 3-D fused expert weights (transformers 5.x: ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I], multiplied per expert group by ``grouped_mm``), rank ``r`` of ``tp`` holds, of every
expert, rows ``r`` of each block of ``gate_up_proj``'s output dim (gate and up sharded alike:
``ShardLayout(1, chunks=2)``) and the matching columns of ``down_proj`` (``ShardLayout(2)``), as
Megatron shards one MLP. The up product reads its input through :class:`TpCopy` (f) and the
down product's partial sums go through :class:`TpReduce` (g): one all-reduce forward and one
backward per expert layer, whatever the number of experts. The placements between come from the
per-op rules (:mod:`autopar.passes.tp.tp_rules`, grouped products in
:mod:`autopar.passes.moe.tp_expert_rules`); nothing here knows what an expert is beyond a 3-D weight.
Experts gathered by id (``bmm(x, w[ids])``: a 3-D parameter indexed by each row's expert id, the
plain-torch fused experts of ``autopar.models.moe``) are sharded alike: ``w_in[ids]`` on its output dim,
``w_out[ids]`` on its contracted dim. Experts held as a list of ``nn.Linear`` modules are ordinary
linears: the region finder (:mod:`autopar.passes.tp.tp_regions`) shards them.

With expert parallelism (:mod:`autopar.passes.moe.moe_expert_parallel`, run before this pass) the f goes
after the dispatch and the g before the combine: every tp rank of an ep group dispatches the same
(replicated) rows to the same ep peers, multiplies them by its shard of the experts, and the g
all-reduces the partial sums over tp before the combine sends them back.

Example::

    >>> import torch
    >>> from autopar.models.hf import build_hf_raw, hf_raw_example
    >>> from autopar.passes.frontend.capture import capture
    >>> from autopar.passes.frontend.annotate import annotate
    >>> model = build_hf_raw("mixtral", use_cache=False)
    >>> (x,), loss_fn, y = hf_raw_example("mixtral")
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.passes.tp.tp_select import select_expert_regions
    >>> from autopar.plan_model import MeshShape
    >>> st = shard_expert_parallel(select_expert_regions(LoweringState.of_graph(gm, mesh=MeshShape(tp=2))))
    >>> specs = st.specs
    >>> specs["model.model.layers.0.mlp.experts.gate_up_proj"], specs["model.model.layers.0.mlp.experts.down_proj"]
    (ShardLayout(dim=1, chunks=2), ShardLayout(dim=2))
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.errors import ShardingError
from autopar.ir.meta_keys import MODULE, PARAM, TP_PLACEMENT, Placement, get_meta, set_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.ops.collectives import TpCopy, TpReduce
from autopar.passes.lowering_state import LoweringState
from autopar.passes.tp.tensor_parallel import localize_sizes, node_where, set_param
from autopar.passes.moe.tp_expert_rules import EXPERT_PRODUCTS, GATHERED_PRODUCTS, expert_product
from autopar.passes.tp.tp_rules import REPLICATE, NoRule, op_name, rule_for, shape_of

__all__ = ["ExpertRegion", "find_expert_regions", "shard_expert_parallel"]

log = logging.getLogger(__name__)
_WEIGHT_OPS = ("transpose", "t", "permute", "to", "_to_copy", "contiguous", "clone", "alias")
_GATHER = "index"  # w[ids]: each row's expert matrix (the gathered form)


@dataclass
class ExpertRegion:
    """One expert MLP: its column and row grouped products, their weights and every placement inside."""

    columns: list[fx.Node] = field(default_factory=list)
    rows: list[fx.Node] = field(default_factory=list)
    placements: dict[fx.Node, Placement] = field(default_factory=dict)
    specs: dict[str, ShardLayout] = field(default_factory=dict)  # parameter target -> its shard
    kinds: dict[str, str] = field(default_factory=dict)  # parameter target -> "expert column" / "expert row"

    def column_params(self) -> list[str]:
        return [t for t, k in self.kinds.items() if k == "expert column"]

    def row_params(self) -> list[str]:
        return [t for t, k in self.kinds.items() if k == "expert row"]


def _is_product(node: fx.Node) -> bool:
    """A grouped expert product, or a ``bmm``/``matmul`` by a 3-D parameter gathered by expert id."""
    if node.op != "call_function":
        return False
    if op_name(node) in EXPERT_PRODUCTS:
        return True
    if op_name(node) not in GATHERED_PRODUCTS or len(node.args) < 2:
        return False
    chain = _weight_chain(node.args[1])
    return chain is not None and any(op_name(n) == _GATHER for n in chain[1:])


def _weight_chain(operand) -> list[fx.Node] | None:
    """[param get_attr, shape ops ..., operand] when ``operand`` is a 3-D parameter read only here."""
    chain = []
    node = operand
    while isinstance(node, fx.Node) and node.op == "call_function" and op_name(node) in _WEIGHT_OPS + (_GATHER,):
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr" or get_meta(node, PARAM) is None:
        return None
    if len(shape_of(node)) != 3 or len(node.users) != 1 or any(len(n.users) != 1 for n in chain):
        return None
    return [node] + chain[::-1]


def _place_weight(chain: list[fx.Node], want: Placement, placed: dict) -> int:
    """Place the parameter on the dim that becomes ``want`` at the operand; returns that dim."""
    for dim in range(3):
        trial = {chain[0]: Placement.shard(dim, want.chunks)}
        try:
            for node in chain[1:]:
                trial[node], _ = rule_for(node)(node, trial)
        except NoRule:
            continue
        if trial[chain[-1]] == want:
            placed.update(trial)
            return dim
    raise NoRule(f"no dim of {chain[0].target} becomes {want} at {chain[-1].name}")


def _chunks(product: fx.Node) -> int:
    """Equal blocks of the product's output dim that its users split apart (fused gate_up -> 2)."""
    rank = len(shape_of(product))
    for user in product.users:
        if user.op == "call_function" and op_name(user) in ("chunk", "split", "split_with_sizes"):
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % rank == rank - 1:
                arg = user.args[1]
                if isinstance(arg, (list, tuple)):
                    return len(arg)
                return arg if op_name(user) == "chunk" else -(-shape_of(product)[-1] // arg)
    return 1


def _grow(region: ExpertRegion, column: fx.Node) -> None:
    """Propagate the column product's shard through the rules to the row products (partial sums)."""
    queue = [column]
    while queue:
        src = queue.pop(0)
        for user in src.users:
            if user in region.placements:
                continue
            if user.op == "output":
                raise NoRule(f"sharded value {src.name} reaches the graph output")
            if _is_product(user):
                chain = _weight_chain(user.args[1])
                if chain is None or user.args[0] is not src:
                    raise NoRule(f"{user.name} reads {src.name} but its weight is not a 3-D expert parameter")
                dim = _place_weight(chain, Placement.shard(1), region.placements)
                out, _ = expert_product(user, region.placements)
                region.rows.append(user)
                region.placements[user] = out
                region.specs[chain[0].target] = ShardLayout(dim)
                region.kinds[chain[0].target] = "expert row"
                continue
            out, need = rule_for(user)(user, region.placements)
            if any(p != REPLICATE and n not in region.placements for n, p in need.items()):
                raise NoRule(f"{user.name} ({op_name(user)}) would need another sharded input")
            region.placements[user] = out
            queue.append(user)


def _region_from(column: fx.Node) -> ExpertRegion:
    chain = _weight_chain(column.args[1])
    if chain is None:
        raise NoRule(f"{column.name}: its weight is not a 3-D parameter read only by it")
    region = ExpertRegion(columns=[column])
    chunks = _chunks(column)
    dim = _place_weight(chain, Placement.shard(2, chunks), region.placements)
    region.placements[column], _ = expert_product(column, region.placements)
    region.specs[chain[0].target] = ShardLayout(dim, chunks)
    region.kinds[chain[0].target] = "expert column"
    _grow(region, column)
    if not region.rows:
        raise NoRule(f"the shard of {column.name} never meets a row product")
    return region


def find_expert_regions(gm: fx.GraphModule, *, rejected: dict | None = None) -> list[ExpertRegion]:
    """Every expert MLP that shards cleanly, in graph order; the others are logged and skipped.

    ``rejected`` receives {product node: why it stays replicated} (autopar.coverage reads it).
    """
    regions, taken = [], set()
    for node in gm.graph.nodes:
        if not _is_product(node) or node in taken:
            continue
        try:
            region = _region_from(node)
        except NoRule as why:
            info = get_meta(node, MODULE)
            log.warning("tensor parallel: experts %s (node %s) stay replicated: %s",
                        info.path if info else "<root>", node.name, why)
            if rejected is not None:
                rejected[node] = str(why)
            continue
        regions.append(region)
        taken.update(region.columns + region.rows)
    return regions


def _check(region: ExpertRegion, tp_size: int) -> None:
    for node, p in region.placements.items():
        what = op_name(node) if node.op == "call_function" else node.target
        why = p.layout.misfit(shape_of(node), tp_size, what=what) if p.kind == "S" else None
        if why is not None:
            raise ShardingError(why, where=node_where(node),
                fix="choose a tp degree that divides the experts' intermediate size (mesh dim 'tp'), or set tp=1")


def _keep(node: fx.Node) -> dict:
    return {k: v for k, v in node.meta.items() if k in ("nn_module_stack", MODULE)}


def _rewrite(gm: fx.GraphModule, region: ExpertRegion, tp_size: int, index: int) -> None:
    g = gm.graph
    for column in region.columns:
        name = f"tp_expert_copy_{index}"
        gm.add_submodule(name, TpCopy(axis="tp", size=tp_size))
        with g.inserting_before(column):
            copy = g.call_module(name, (column.args[0],))
        copy.meta.update(_keep(column))
        column.args = (copy, *column.args[1:])
    for i, row in enumerate(region.rows):
        name = f"tp_expert_reduce_{index}" + (f"_{i}" if i else "")
        gm.add_submodule(name, TpReduce(axis="tp", size=tp_size))
        with g.inserting_after(row):
            reduced = g.call_module(name, (row,))
        reduced.meta.update(_keep(row))
        row.replace_all_uses_with(reduced, delete_user_cb=lambda n: n is not reduced)
    for node, p in region.placements.items():
        set_meta(node, TP_PLACEMENT, p)
        if p.kind == "S" and node.op == "call_function":
            localize_sizes(node, p, tp_size)


def shard_expert_parallel(st: LoweringState) -> LoweringState:
    """Shard every expert region of ``st.expert_regions`` over the Plan's tp ranks (``specs`` gains their
    weights); the state as it was without any."""
    gm, regions, tp_size, tp_rank = st.gm, st.expert_regions, st.plan.mesh.tp, st.tp_rank
    if not regions:
        return st
    specs: dict[str, ShardLayout] = {}
    for index, region in enumerate(regions):
        _check(region, tp_size)
        specs.update(region.specs)
        _rewrite(gm, region, tp_size, index)
    for target, spec in specs.items():
        set_param(gm, target, spec.cut(gm.get_parameter(target).detach(), rank=tp_rank, size=tp_size))
    gm.graph.lint()
    gm.recompile()
    log.info("tensor parallel: %d expert regions, %d sharded expert weights", len(regions), len(specs))
    return dataclasses.replace(st, gm=gm, specs={**st.specs, **specs})
