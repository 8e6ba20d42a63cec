"""ZeRO-3 as a graph pass: gather each group of dp-sharded parameters before its first use, free after its last.

Parameters are grouped by the pipeline unit of their first use (``model.blocks.3``: one
collective per block, as FSDP wraps one module), in order of first use. For each group the pass
inserts, visibly in the stage graph:

- ``zero3_gather_k = ZeroGather(*shards)`` just before the group's first use, with one
  ``getitem`` per parameter; every use now reads the gathered full parameter. Forward
  all-gathers (and starts the next group's gather: prefetch); backward reduce-scatters.
- ``zero3_free_k = ZeroFree(last_use, *full_params)`` right after the group's last use (a use of
  a view of the parameters, such as a transposed weight, counts); the nodes that read ``last_use``
  read ``zero3_free_k`` instead. Forward frees the full parameters;
  backward gathers them again (and prefetches the group whose free comes before: backward's next).

Mixture-of-experts expert tensors split over ep (``experts``, :mod:`autopar.passes.moe.moe_expert_parallel`)
are grouped apart from the other parameters of their unit and sharded over ``edp``, the dp/ep ranks
that hold the same experts, so a rank keeps 1/(ep * edp) = 1/dp of each expert tensor; with
dp == ep (edp = 1) each rank already holds its experts alone and ZeRO-3 leaves them whole.

Runtime behaviour is in :mod:`autopar.ops.zero3_ops`. The parameters stay full-sized in the
GraphModule, so a plan made in a plain process reads as the program; the runtime swaps in each
rank's shards (:func:`autopar.ops.zero3_ops.shard_zero3_parameters`).

Example::

    >>> import torch, autopar
    >>> from autopar.models import build_model, lm_loss
    >>> x = torch.randint(0, 128, (8, 16))
    >>> r = autopar.plan(build_model("gpt_tiny", seq_len=16), (2, 1, 1), example_inputs=(x,),
    ...                  loss_fn=lm_loss, example_target=x, zero_stage=3)
    >>> from autopar.ops.zero3_ops import ZeroGather
    >>> from autopar.ops.collectives import collective_nodes
    >>> len(collective_nodes(r.graph(0), ZeroGather))  # embeddings, 2 blocks, final norm
    5
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir.graph_names import user_name
from autopar.ir.meta_keys import MODULE, TENSOR, get_meta
from autopar.ir.stage_graph import StageGraph
from autopar.ops.zero3_ops import ZeroFree, ZeroGather
from autopar.parallel_dims import ParallelDims
from autopar.passes.lowering_state import LoweringState
from autopar.runtime.schedules.registry import splits_backward

__all__ = ["shard_parameters_zero3", "shard_stage_zero3", "zero3_groups", "check_zero3"]


def check_zero3(pipeline) -> None:
    """Refuse pipelines (the Plan's ``PipelinePlan``) ZeRO-3 cannot run: split backward computes weight
    gradients apart."""
    if splits_backward(pipeline.schedule):
        raise PlanError(f"zero_stage=3 does not combine with the split-backward schedule {pipeline.schedule!r}: "
                        f"its W action computes full weight gradients outside the graph's reduce-scatter",
                        where="compile(zero_stage=3, schedule=...)",
                        fix="use schedule='1f1b' (or gpipe, interleaved_1f1b), or zero_stage<=2")


def _is_trainable(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "get_attr":
        return False
    try:
        p = gm.get_parameter(node.target)
    except AttributeError:
        return False
    return isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype.is_floating_point


def zero3_groups(gm: fx.GraphModule, *, experts: frozenset[str] = frozenset()) -> list[list[fx.Node]]:
    """get_attr nodes of trainable parameters, grouped by the unit of their first use (and dtype, and whether
    they are ``experts``: user names of expert tensors split over ep), in use order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple, list[fx.Node]] = {}
    first: dict[tuple, int] = {}
    for node in gm.graph.nodes:
        if not _is_trainable(gm, node) or not node.users:
            continue
        user = min(node.users, key=order.__getitem__)
        info = get_meta(user, MODULE)
        unit = (info.unit if info is not None else node.target, gm.get_parameter(node.target).dtype,
                user_name(node.target) in experts)
        groups.setdefault(unit, []).append(node)
        first[unit] = min(first.get(unit, order[user]), order[user])
    return [groups[u] for u in sorted(groups, key=first.__getitem__)]


def _token_after(node: fx.Node, order: dict) -> fx.Node:
    """The node after which ``node``'s value is complete: itself, or its last getitem for a tuple."""
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    return max(items, key=order.__getitem__) if items else node


def _is_view(node: fx.Node) -> bool:
    """Does ``node``'s output alias an input's storage (a view: transpose, view, expand, chunk, ...)?"""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _last_use(fulls: list[fx.Node], order: dict) -> fx.Node:
    """The last node reading the full parameters' storage: their users, and through views the views' users
    (a free after a transpose would leave the transposed weight pointing at freed storage)."""
    last, frontier, seen = None, list(fulls), set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            last = user if last is None or order[user] > order[last] else last
            if _is_view(user) or (user.target is operator.getitem and _is_view(node)):
                frontier.append(user)
    return last


def _insert_group(gm: fx.GraphModule, k: int, nodes: list[fx.Node], *, dp: int, num_groups: int,
                  axis: str = "dp", size: int | None = None) -> None:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use = min((u for n in nodes for u in n.users), key=order.__getitem__)
    params = [gm.get_parameter(n.target) for n in nodes]
    name = f"zero3_gather_{k}"
    size = dp if size is None else size
    gm.add_submodule(name, ZeroGather(size=size, index=k, targets=tuple(n.target for n in nodes),
                                      shapes=tuple(tuple(p.shape) for p in params), dtype=params[0].dtype,
                                      next_gather=f"zero3_gather_{k + 1}" if k + 1 < num_groups else None,
                                      axis=axis, divide_by=dp))
    with graph.inserting_before(first_use):
        attrs = []
        for n in nodes:
            attr = graph.get_attr(n.target)
            attr.meta = dict(n.meta)
            attrs.append(attr)
        gather = graph.call_module(name, tuple(attrs))
        fulls = []
        for i, n in enumerate(nodes):
            full = graph.call_function(operator.getitem, (gather, i))
            full.meta = {key: v for key, v in n.meta.items() if key == TENSOR}
            fulls.append(full)
    for n, full in zip(nodes, fulls):
        n.replace_all_uses_with(full)
        graph.erase_node(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    token = _token_after(_last_use(fulls, order), order)
    free_name = f"zero3_free_{k}"
    gm.add_submodule(free_name, ZeroFree(size=size, gather=name, axis=axis))
    with graph.inserting_after(token):
        free = graph.call_module(free_name, (token, *fulls))
    free.meta = {key: v for key, v in token.meta.items() if key in (TENSOR, MODULE)}
    token.replace_all_uses_with(free, delete_user_cb=lambda user: user is not free)


def shard_parameters_zero3(st: LoweringState) -> LoweringState:
    """Every stage graph gathering its parameters over dp (:func:`shard_stage_zero3`); the MoE experts split
    over ep (``st.experts``) over edp, the ranks holding the same experts."""
    experts = frozenset(user_name(t) for t in st.experts)
    return dataclasses.replace(st, stages=tuple(shard_stage_zero3(g, dims=st.plan.dims, experts=experts)
                                                for g in st.stages))


def shard_stage_zero3(stage: StageGraph, *, dims: ParallelDims, experts: frozenset[str] = frozenset()) -> StageGraph:
    """Rewrite ``stage.gm`` in place for ZeRO-3 over the ``dims.dp`` ranks (a no-op for dp=1), over dp x cp
    (``dcp``) with context parallelism; ``experts`` (user names of the expert tensors split over ep) over the edp
    ranks holding the same experts."""
    dp, edp = dims.dcp, dims.edcp  # experts: over the ranks holding them (edp x cp)
    data_axis, expert_axis = ("dcp", "edcp") if dims.cp > 1 else ("dp", "edp")
    if dp == 1:
        return stage
    gm = stage.gm
    groups = [g for g in zero3_groups(gm, experts=experts)
              if edp > 1 or user_name(g[0].target) not in experts]  # edp = 1: each rank holds its experts alone
    for k, nodes in enumerate(groups):
        on_edp = user_name(nodes[0].target) in experts
        _insert_group(gm, k, nodes, dp=dp, num_groups=len(groups), axis=expert_axis if on_edp else data_axis,
                      size=edp if on_edp else dp)
    # backward meets the frees in reverse graph order: each prefetches the gather of the free before it
    frees = [gm.get_submodule(n.target) for n in gm.graph.nodes
             if n.op == "call_module" and isinstance(gm.get_submodule(n.target), ZeroFree)]
    for before, free in zip(frees, frees[1:]):
        free.prev_gather = before.gather
    gm.graph.lint()
    gm.recompile()
    return stage
