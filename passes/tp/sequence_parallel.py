"""Sequence parallelism: the replicated stretches between tensor-parallel regions, sharded on the sequence.

After :func:`autopar.passes.tp.tensor_parallel.shard_tensor_parallel`, everything outside the regions
(norms, dropout, bias adds, the residual stream) runs replicated on every tp rank. Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") shard those ops on the
sequence dim instead, which divides their activations by tp at the same communication volume:

- every g (:class:`TpReduce`) becomes a reduce-scatter on the sequence dim (:class:`SpReduceScatter`);
- from there, the sequence shard is propagated forward through the per-op rules (elementwise ops
  with broadcasting, views, reductions over other dims, ``layer_norm``);
- an op that needs another operand sharded *pulls* it: a replicated value (the embedding sum,
  a position table) is split once with :class:`TpScatter`, and propagation starts again with it;
- every f (:class:`TpCopy`) reading a shard becomes an all-gather (:class:`SpAllGather`), whose
  backward reduce-scatters the columns' partial input gradients;
- a replicated consumer with no rule (a replicated LM head, the graph output) reads the value
  through :class:`TpGather`.

The sharded dim of a g output is the one before its feature dim (dim 1 of ``[b, s, h]``).
Replicated parameters read inside the shard (norm weights, row-linear biases) get a partial
gradient on each rank; :func:`shard_sequence_parallel` returns their names so the runtime
all-reduces those gradients over tp once per step, as Megatron does. A replicated activation
read there gets a :class:`TpCopy`, whose backward does the same per use.

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> from autopar.passes.frontend.annotate import annotate
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> from autopar.passes.tp.tensor_parallel import shard_tensor_parallel
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.passes.tp.tp_select import select_tp_regions
    >>> from autopar.plan_model import MeshShape
    >>> st = shard_tensor_parallel(select_tp_regions(LoweringState.of_graph(gm, mesh=MeshShape(tp=2))))
    >>> gm = annotate(st.gm, example_inputs=(x, y))      # shapes of the new nodes (the pass manager does this)
    >>> st = shard_sequence_parallel(st)
    >>> st.partial_grads[:2]
    ('model.blocks.0.ln_1.weight', 'model.blocks.0.ln_1.bias')
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.errors import ShardingError
from autopar.ir.meta_keys import MODULE, PARAM, TENSOR, TP_PLACEMENT, Placement, get_meta, set_meta
from autopar.ops.collectives import SpAllGather, SpReduceScatter, TpCopy, TpGather, TpReduce, TpScatter
from autopar.ops.tp_ops import SpGatherLinear
from autopar.passes.lowering_state import LoweringState
from autopar.passes.pipeline.pipeline_split import needs_grad
from autopar.passes.tp.tensor_parallel import localize_sizes, node_where
from autopar.passes.tp.tp_rules import RULES, REPLICATE, NoRule, op_name, shape_of
from autopar.runtime.schedules.registry import splits_backward

__all__ = ["SpSolution", "solve_sequence_parallel", "shard_sequence_parallel", "fuse_gather_linears", "SP_OPS"]

log = logging.getLogger(__name__)

SP_OPS = frozenset({
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "exp", "pow", "rsqrt",
    "sqrt", "dropout", "clone", "contiguous", "to", "_to_copy", "type_as", "alias", "detach", "where",
    "masked_fill", "abs", "erf", "square", "reciprocal", "rsub", "clamp", "maximum", "minimum",
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze",
    "mean", "sum", "amax", "layer_norm",
})
"""Ops that run on sequence shards (per-token ops); anything else reads a gathered value."""


def _layer_norm(node: fx.Node, placed: dict):
    src = node.args[0]
    p = placed.get(src)
    if p is None or p.kind != "S":
        raise NoRule(f"{node.name}: input is not sharded")
    if p.dim >= len(shape_of(src)) - len(node.args[1]):
        raise NoRule(f"{node.name} normalises over the sharded dim")
    need = {a: REPLICATE for a in node.args[2:4] if isinstance(a, fx.Node)}
    return p, {src: p, **need}


def _sp_rule(node: fx.Node, placed: dict):
    if node.op != "call_function" or op_name(node) not in SP_OPS:
        raise NoRule(f"{node.name} does not run on sequence shards")
    rule = _layer_norm if op_name(node) == "layer_norm" else RULES[op_name(node)]
    out, need = rule(node, placed)
    if out.kind != "S" or out.chunks != 1 or any(p.chunks != 1 for p in need.values()):
        raise NoRule(f"{node.name} would interleave the sequence shard")
    return out, need


def _module_of(gm: fx.GraphModule, node: fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


@dataclass
class SpSolution:
    """Where the sequence shard lives and which conversions the rewrite inserts."""

    placements: dict[fx.Node, Placement] = field(default_factory=dict)
    reduces: list[fx.Node] = field(default_factory=list)        # g -> reduce-scatter
    copies: list[fx.Node] = field(default_factory=list)         # f reading a shard -> all-gather
    scatters: dict[fx.Node, Placement] = field(default_factory=dict)  # replicated values split once
    gathers: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # shard -> replicated readers
    operands: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # (shard op, replicated input)
    pulls: dict[fx.Node, Placement] = field(default_factory=dict)


def _seeds(gm: fx.GraphModule, tp_size: int) -> dict[fx.Node, Placement]:
    seeds = {}
    for node in gm.graph.nodes:
        if not isinstance(_module_of(gm, node), TpReduce):
            continue
        shape = shape_of(node)
        if len(shape) < 2:
            continue
        dim = len(shape) - 2
        if shape[dim] % tp_size:
            raise ShardingError(
                f"sequence parallelism splits dim {dim} of {tuple(shape)} (size {shape[dim]}), "
                f"not divisible by tp={tp_size}", where=node_where(node),
                fix=f"use a sequence length that is a multiple of {tp_size}, or sequence_parallel=False")
        seeds[node] = Placement.shard(dim)
    return seeds


def _can_pull(gm: fx.GraphModule, node: fx.Node, p: Placement, tp_size: int) -> bool:
    info = get_meta(node, TENSOR)
    if info is None or info.shape is None or info.dtype is None or not info.dtype.is_floating_point:
        return False
    placed = get_meta(node, TP_PLACEMENT)
    if placed is not None and placed.kind != "R" or _module_of(gm, node) is not None:
        return False
    if info.shape[p.dim] % tp_size:
        raise ShardingError(
            f"sequence parallelism splits dim {p.dim} of {tuple(info.shape)} (size {info.shape[p.dim]}), "
            f"not divisible by tp={tp_size}", where=node_where(node),
            fix=f"use a sequence length that is a multiple of {tp_size}, or sequence_parallel=False")
    return True


def _visit(gm, node: fx.Node, sol: SpSolution, tp_size: int):
    """Place ``node`` from its sharded inputs: (placement, replicated inputs), or raise NoRule."""
    out, need = _sp_rule(node, sol.placements)
    missing = {a: p for a, p in need.items() if p.kind == "S" and a not in sol.placements}
    if not all(_can_pull(gm, a, p, tp_size) for a, p in missing.items()):
        raise NoRule(f"{node.name} needs an input that cannot be split")
    sol.pulls = missing
    return out, [a for a, p in need.items() if p == REPLICATE]


def _propagate(gm: fx.GraphModule, seeds: dict, pulled: dict, tp_size: int) -> SpSolution:
    """One forward sweep in graph order; stops at the first op that pulls a replicated input in."""
    sol = SpSolution(placements=dict(seeds), reduces=list(seeds))
    for node in gm.graph.nodes:
        sharded = [a for a in node.all_input_nodes if a in sol.placements]
        if node in seeds or not (sharded or node in pulled):
            continue
        if isinstance(_module_of(gm, node), TpCopy):
            sol.copies.append(node)
            continue
        try:
            out, replicated = _visit(gm, node, sol, tp_size) if sharded else (None, [])
        except NoRule:
            out = None
        if sol.pulls:
            return sol
        if node in pulled and out != pulled[node]:  # computed whole, split once for its shard readers
            sol.placements[node] = sol.scatters[node] = pulled[node]
            for a in sharded:  # whole: its sharded inputs read gathered (GPT-2's residual add of a batch-sharded
                sol.gathers.setdefault(a, []).append(node)  # Conv1D output and the sequence-sharded embeddings)
        elif out is not None:
            sol.placements[node] = out
            sol.operands += [(node, a) for a in replicated]
        else:
            for a in sharded:
                sol.gathers.setdefault(a, []).append(node)
    return sol


def solve_sequence_parallel(gm: fx.GraphModule, *, tp_size: int) -> SpSolution:
    """Propagate sequence shards from every g; start again whenever a replicated value is pulled in."""
    seeds, pulled = _seeds(gm, tp_size), {}
    for _ in range(len(gm.graph.nodes)):
        sol = _propagate(gm, seeds, pulled, tp_size)
        if not sol.pulls:
            return sol
        pulled.update(sol.pulls)
    raise AssertionError("sequence-parallel propagation did not settle")


# -- the rewrite --------------------------------------------------------------------------------
class _Namer:
    def __init__(self, gm: fx.GraphModule):
        self.gm, self.counts = gm, {}

    def add(self, prefix: str, module) -> str:
        while True:
            i = self.counts.get(prefix, 0)
            self.counts[prefix] = i + 1
            name = f"{prefix}_{i}"
            if not hasattr(self.gm, name):
                self.gm.add_submodule(name, module)
                return name


def _copy_meta(new: fx.Node, like: fx.Node) -> None:
    new.meta.update({k: v for k, v in like.meta.items() if k in ("nn_module_stack", MODULE)})


def _replace_module_node(gm, namer, node, prefix, module) -> fx.Node:
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(namer.add(prefix, module), node.args)
    _copy_meta(new, node)
    node.replace_all_uses_with(new)
    old = node.target
    gm.graph.erase_node(node)
    gm.delete_submodule(old)
    return new


def _insert_after(gm, namer, value, prefix, module, readers) -> fx.Node:
    with gm.graph.inserting_after(value):
        new = gm.graph.call_module(namer.add(prefix, module), (value,))
    _copy_meta(new, value if value.op != "placeholder" else readers[0])
    for reader in readers:
        reader.replace_input_with(value, new)
    return new


def _param_sources(node: fx.Node) -> list[fx.Node] | None:
    """The parameters a value is computed from, or None if it also depends on an activation."""
    params, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or n.op == "call_module":
            return None
        if n.op == "get_attr":
            params += [n] if get_meta(n, PARAM) is not None and get_meta(n, PARAM).is_parameter else []
        stack.extend(n.all_input_nodes)
    return params


def _replicated_operands(gm, namer, sol: SpSolution, grad, tp_size: int) -> list[str]:
    """Partial-gradient parameters (returned) and a TpCopy on every other replicated grad input."""
    partial: list[str] = []
    for node, operand in sol.operands:
        if not grad(operand):
            continue
        params = _param_sources(operand)
        if params is not None:
            partial += [p.target for p in params if p.target not in partial]
            continue
        _insert_after(gm, namer, operand, "sp_copy", TpCopy(axis="tp", size=tp_size), [node])
    return partial


def _fusable(gather: fx.Node) -> list[fx.Node] | None:
    users = list(gather.users)
    for u in users:
        ok = (u.op == "call_function" and op_name(u) == "linear" and u.args[0] is gather and not u.kwargs
              and all(isinstance(a, fx.Node) and a.op == "get_attr" for a in u.args[1:]))
        if not ok:
            return None
    return users or None


def fuse_gather_linears(gm: fx.GraphModule) -> fx.GraphModule:
    """Fuse each all-gather with the column linears it feeds (:class:`SpGatherLinear`).

    The fused node saves the sequence shard rather than the gathered input and gathers it again
    in backward, so no activation of a block is stored whole.
    """
    namer = _Namer(gm)
    for gather in [n for n in gm.graph.nodes if isinstance(_module_of(gm, n), SpAllGather)]:
        linears = _fusable(gather)
        if linears is None:
            continue
        module = gm.get_submodule(gather.target)
        has_bias = tuple(len(lin.args) > 2 for lin in linears)
        params = [a for lin in linears for a in lin.args[1:]]
        name = namer.add("sp_gather_linear", SpGatherLinear(axis="tp", size=module.size, dim=module.dim,
                                                            has_bias=has_bias))
        with gm.graph.inserting_after(gather):
            fused = gm.graph.call_module(name, (gather.args[0], *params))
        _copy_meta(fused, gather)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for p in params:
            if order[p] > order[fused]:
                fused.prepend(p)  # a parameter read has no inputs: moving it up is always safe
        anchor = fused
        for i, lin in enumerate(linears):
            with gm.graph.inserting_after(anchor):
                anchor = out = gm.graph.call_function(operator.getitem, (fused, i))
            out.meta.update({k: v for k, v in lin.meta.items()
                             if k in ("nn_module_stack", MODULE, TP_PLACEMENT)})
            lin.replace_all_uses_with(out)
        for lin in linears:
            gm.graph.erase_node(lin)
        gm.graph.erase_node(gather)
        gm.delete_submodule(gather.target)
    gm.graph.lint()
    gm.recompile()
    return gm


def shard_sequence_parallel(st: LoweringState) -> LoweringState:
    """Shard the stretches between tp regions on the sequence; ``partial_grads``: the replicated parameters
    read on sequence shards, whose gradients the runtime sums over tp.

    Each all-gather is fused with its column linears (:func:`fuse_gather_linears`) unless the Plan's
    schedule splits backward (the zero-bubble schedules need them apart).
    """
    gm, tp_size = st.gm, st.plan.mesh.tp
    regather = not splits_backward(st.plan.pipeline.schedule)
    sol = solve_sequence_parallel(gm, tp_size=tp_size)
    grad = needs_grad(gm)
    namer = _Namer(gm)
    partial = _replicated_operands(gm, namer, sol, grad, tp_size)
    copy_dims = {copy: sol.placements[copy.args[0]].dim for copy in sol.copies}
    for node, p in sol.placements.items():
        if node not in sol.scatters:  # a pulled value is computed whole; its scatter holds the shard
            set_meta(node, TP_PLACEMENT, p)
            localize_sizes(node, p, tp_size)
    for value, p in sol.scatters.items():
        readers = [u for u in value.users if u in sol.placements or u in sol.copies]
        new = _insert_after(gm, namer, value, "sp_scatter", TpScatter(axis="tp", size=tp_size, dim=p.dim),
                            readers)
        set_meta(new, TP_PLACEMENT, p)
        sol.gathers.pop(value, None)  # replicated readers keep reading the unsplit value
    for value, readers in sol.gathers.items():
        dim = sol.placements[value].dim
        _insert_after(gm, namer, value, "sp_gather", TpGather(axis="tp", size=tp_size, dim=dim), readers)
    for copy, dim in copy_dims.items():
        _replace_module_node(gm, namer, copy, "sp_all_gather", SpAllGather(axis="tp", size=tp_size, dim=dim))
    for reduce in sol.reduces:
        dim = sol.placements[reduce].dim
        new = _replace_module_node(gm, namer, reduce, "sp_reduce_scatter",
                                   SpReduceScatter(axis="tp", size=tp_size, dim=dim))
        set_meta(new, TP_PLACEMENT, Placement.shard(dim))
    gm.graph.lint()
    gm.recompile()
    if regather:
        fuse_gather_linears(gm)
    log.info("sequence parallel: %d reduce-scatters, %d all-gathers, %d scatters, %d gathers, "
             "%d partial-gradient parameters", len(sol.reduces), len(sol.copies), len(sol.scatters),
             len(sol.gathers), len(partial))
    return dataclasses.replace(st, gm=gm, partial_grads=tuple(partial))
