"""Transform: expert parallelism. Each MoE layer's experts are split over ``ep`` ranks carved out of dp
(the Plan's ``expert_parallel``; this rank's ep index from its dp index, :class:`~autopar.parallel_dims.ParallelDims`).

For every layer :mod:`autopar.passes.moe.moe_detect` recognised in the ``grouped`` or ``gathered`` form:

1. the 3-D expert tensors keep this ep rank's experts only (``[E, ...] -> [E/ep, ...]``, rank ``j``
   holding experts ``j*E/ep ..``);
2. a :class:`~autopar.ops.moe_ops.MoeDispatch` node goes before the first expert matmul: it sends
   each row to its expert's rank and returns the rows that arrived, their local expert ids and the
   local grouped-matmul offsets, which replace the graph's own (``gathered``: the ids indexing the expert
   tensors; ``grouped``: the offsets of every grouped matmul);
3. a :class:`~autopar.ops.moe_ops.MoeCombine` node goes after the last expert matmul: the outputs
   go back to their rows' ranks, in the order the graph had them, so the routing weights, the un-sort
   and the per-token sum after it run unchanged.

Both nodes carry ``autopar.moe_exchange`` (:class:`~autopar.ir.meta_keys.MoeExchange`): the layer,
the ep size, every ep rank's expert range and the capacity factor (what the HTML report shows).

Between the two nodes only the expert rows flow: a node there that reads another per-row tensor is
refused (:class:`~autopar.errors.ShardingError`), as are ``loop`` layers (a ModuleList of experts
run on every token: nothing to dispatch) and an ``ep`` that does not divide a layer's experts.

Example::

    >>> import torch
    >>> from autopar.models.moe import build_moe, moe_loss
    >>> from autopar.passes.frontend.capture import capture
    >>> idx = torch.randint(0, 64, (2, 8))
    >>> gm = capture(build_moe("switch"), (idx,), loss_fn=moe_loss, example_target=idx).gm
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.plan_model import MeshShape
    >>> st = shard_experts(LoweringState.of_graph(gm, mesh=MeshShape(dp=2), dp_rank=1, expert_parallel=2))
    >>> [type(st.gm.get_submodule(n.target)).__name__ for n in st.gm.graph.nodes if n.op == "call_module"]
    ['MoeDispatch', 'MoeCombine', 'MoeDispatch', 'MoeCombine']
    >>> tuple(st.gm.get_parameter(st.experts[0]).shape)
    (2, 32, 64)
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from autopar.errors import ShardingError
from autopar.ir.meta_keys import MODULE, MOE_EXCHANGE, PARAM, MoeExchange, MoeLayer, get_meta, set_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.ops.moe_ops import MoeCombine, MoeDispatch
from autopar.passes.lowering_state import LoweringState
from autopar.passes.moe.moe_detect import MoeReport, ancestors, annotate_moe, descendants, strip
from autopar.passes.tp.tensor_parallel import set_param

__all__ = ["shard_experts", "check_expert_parallel"]

_KEEP = ("nn_module_stack", MODULE)


def check_expert_parallel(report: MoeReport, *, ep: int) -> None:
    """ShardingError unless every layer can be split over ``ep`` ranks (and there is a layer at all)."""
    if not report.layers:
        why = "; ".join(f"{where}: {reason}" for where, reason in report.unrecognised) or "no router top-k in the graph"
        raise ShardingError(f"expert_parallel={ep} but no mixture-of-experts layer was recognised ({why})",
                            where="the captured graph", fix="drop expert_parallel, or see docs/moe.md for the "
                            "router, expert and combine forms that are recognised")
    for layer in report.layers:
        if layer.form == "loop":
            raise ShardingError(
                f"MoE layer {layer.path} runs every expert on every token (a loop over a ModuleList of "
                f"{layer.num_experts} experts): there are no routed rows to dispatch",
                where=f"module {layer.path}",
                fix="store the experts as fused 3-D tensors indexed by expert id (or use transformers' "
                    "grouped_mm experts), or drop expert_parallel")
        if layer.num_experts % ep:
            raise ShardingError(f"MoE layer {layer.path} has {layer.num_experts} experts, not divisible by "
                                f"expert_parallel={ep}", where=f"module {layer.path}",
                                fix=f"use an expert_parallel that divides {layer.num_experts}")


def _region_check(layer: MoeLayer, start: list[fx.Node], last: fx.Node, allowed: set) -> None:
    """Between dispatch and combine only the dispatched rows (and expert weights) may flow."""
    region = descendants(start) & ancestors([last])
    for node in region:
        for arg in node.all_input_nodes:
            if arg in region or arg in allowed:
                continue
            if not any(a.op == "placeholder" for a in ancestors([arg])):
                continue  # weights and constants
            raise ShardingError(
                f"node {node.name} between the expert matmuls of {layer.path} reads {arg.name}, a per-token "
                f"value that is not dispatched with the rows", where=f"node {node.name} (module {layer.path})",
                fix="apply per-row factors (routing weights) before the first or after the last expert matmul, "
                    "or drop expert_parallel")


def _slice_experts(gm: fx.GraphModule, layer: MoeLayer, *, ep: int, ep_rank: int) -> None:
    for target in layer.expert_weights:  # this ep rank's experts: block ep_rank of dim 0
        set_param(gm, target, ShardLayout(0).cut(gm.get_parameter(target).detach(), rank=ep_rank, size=ep))
    for node in gm.graph.nodes:
        info = get_meta(node, PARAM) if node.op == "get_attr" and node.target in layer.expert_weights else None
        if info is not None:
            set_meta(node, PARAM, dataclasses.replace(info, numel=info.numel // ep))


def _exchange(layer: MoeLayer, index: int, role: str, *, ep: int, ep_rank: int, capacity_factor) -> MoeExchange:
    """What the report reads off a dispatch or combine node: the layer, the ep group, every ep rank's experts."""
    local = layer.num_experts // ep
    return MoeExchange(role=role, layer=layer.path, index=index, num_experts=layer.num_experts, ep=ep,
                       ep_rank=ep_rank, experts=tuple((j * local, (j + 1) * local) for j in range(ep)),
                       expert_weights=tuple(layer.expert_weights), capacity_factor=capacity_factor)


def _rewrite_layer(gm: fx.GraphModule, layer: MoeLayer, index: int, *, ep: int, ep_rank: int,
                   capacity_factor) -> None:
    nodes = {n.name: n for n in gm.graph.nodes}
    ops = [nodes[n] for n in layer.expert_ops]
    first, last = ops[0], ops[-1]
    row_ids = nodes[layer.row_ids]
    name = f"moe_dispatch_{index}"
    gm.add_submodule(name, MoeDispatch(axis="ep", size=ep, num_experts=layer.num_experts,
                                       capacity_factor=capacity_factor))
    gm.add_submodule(f"moe_combine_{index}", MoeCombine(axis="ep", size=ep))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = [n for n in gm.graph.nodes if str(n.target) == "aten.index.Tensor" and strip(n.args[0]).op == "get_attr"
               and strip(n.args[0]).target in layer.expert_weights]
    with gm.graph.inserting_before(min([first, *gathers], key=order.get)):
        dispatch = gm.graph.call_module(name, (first.args[0], row_ids))
        outs = [gm.graph.call_function(operator.getitem, (dispatch, i)) for i in range(4)]
    rows, ids, offsets, routing = outs
    for node in (dispatch, *outs):
        node.meta.update({k: v for k, v in first.meta.items() if k in _KEEP})
    set_meta(dispatch, MOE_EXCHANGE, _exchange(layer, index, "dispatch", ep=ep, ep_rank=ep_rank,
                                               capacity_factor=capacity_factor))
    first.args = (rows, *first.args[1:])
    if layer.form == "grouped":
        for op in ops:
            if "offs" in op.kwargs:
                op.kwargs = {**op.kwargs, "offs": offsets}
            else:
                op.args = (*op.args[:2], offsets, *op.args[3:])
    for node in gathers:  # gathered: the expert tensors are indexed by the local ids
        node.args = (node.args[0], [ids])
    with gm.graph.inserting_after(last):
        combine = gm.graph.call_module(f"moe_combine_{index}", (last, routing))
    combine.meta.update({k: v for k, v in last.meta.items() if k in _KEEP})
    set_meta(combine, MOE_EXCHANGE, _exchange(layer, index, "combine", ep=ep, ep_rank=ep_rank,
                                              capacity_factor=capacity_factor))
    last.replace_all_uses_with(combine, delete_user_cb=lambda user: user is not combine)
    weights = {n for n in gm.graph.nodes if n.op == "get_attr"}
    _region_check(layer, [rows, ids, offsets], last, {dispatch, rows, ids, offsets, routing} | weights)


def shard_experts(st: LoweringState) -> LoweringState:
    """Split every MoE layer's experts over the Plan's ep ranks; ``experts``: the expert tensors' targets.

    The Plan's ``moe_capacity_factor`` (read here only): None (dropless), or each expert takes
    ``ceil(factor * rows / E)`` rows per rank."""
    gm, ep, ep_rank, capacity_factor = st.gm, st.plan.dims.ep, st.ep_rank, st.plan.moe_capacity_factor
    report = annotate_moe(gm)
    check_expert_parallel(report, ep=ep)
    experts: list[str] = []
    for index, layer in enumerate(report.layers):
        _slice_experts(gm, layer, ep=ep, ep_rank=ep_rank)
        _rewrite_layer(gm, layer, index, ep=ep, ep_rank=ep_rank, capacity_factor=capacity_factor)
        experts.extend(layer.expert_weights)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return dataclasses.replace(st, gm=gm, experts=st.experts + tuple(experts))
