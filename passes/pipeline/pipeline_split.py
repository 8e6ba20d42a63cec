"""Pipeline split: one GraphModule per stage, joined by visible send/recv nodes.

Reads ``autopar.stage`` (written by :func:`autopar.passes.pipeline.partition.assign_stages`). Every value
computed on stage a and read on stage b > a becomes an *edge*: ``send_<edge>`` at the end of a,
``recv_<edge>`` at the start of b. Parameters and buffers are copied into every stage that reads
them (a tied embedding/LM-head weight lands on two stages; its
:class:`~autopar.ir.stage_graph.StageGraph` lists it so the runtime sums its gradient across them). Graph inputs are read directly on every stage that
needs them: each rank holds its batch. The graph's output belongs to the last stage.

A graph with symbolic input dims (:mod:`autopar.passes.frontend.dynamic_capture`) reads sizes with
``aten.sym_size`` and computes others from them: such *size nodes* are never sent; every stage
that reads one computes it again from its own inputs. An edge whose shape depends on a symbolic
dim carries it as :class:`~autopar.ir.dynamic_shapes.SizeExpr` (``dims``, fit by
:func:`autopar.passes.frontend.symbolic_sizes.symbolic_shapes`), which the recv node evaluates per microbatch.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.ir.graph_names import user_name
from autopar.ir.meta_keys import PARAM, STAGE, TENSOR, get_meta
from autopar.ir.stage_graph import Edge, StageGraph
from autopar.ops.p2p import RecvActivation, SendActivation
from autopar.passes.lowering_state import LoweringState
from autopar.passes.frontend.symbolic_sizes import symbolic_shapes

__all__ = ["split_pipeline", "split_graph", "needs_grad", "param_stages", "size_nodes",
           "edge_values"]

#: what computes a size from sizes: torch's symbolic-size ops and Python's integer arithmetic
_SIZE_OPS = frozenset({torch.ops.aten.sym_size.int, operator.add, operator.sub, operator.mul, operator.floordiv,
                       operator.mod, operator.neg, torch.sym_max, torch.sym_min, torch.sym_int})


def needs_grad(gm: fx.GraphModule):
    """A predicate: does the value of a node depend differentiably on a trainable parameter?"""
    memo: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        info = get_meta(node, TENSOR)
        floating = info is not None and info.dtype is not None and info.dtype.is_floating_point
        if node.op == "get_attr":
            param = get_meta(node, PARAM)
            memo[node] = bool(param and param.is_parameter) and floating
        elif node.op == "placeholder" or not floating or "detach" in str(node.target):
            memo[node] = False
        else:
            memo[node] = any(memo.get(a, False) for a in node.all_input_nodes)
    return lambda n: memo.get(n, False)


def size_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that compute sizes from the inputs' sizes (``sym_size`` and integer arithmetic on them)."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SIZE_OPS and all(
                a in found or (a.op == "placeholder" and node.target is torch.ops.aten.sym_size.int)
                for a in node.all_input_nodes):
            found.add(node)
    return found


def _stage_of(node: fx.Node, last: int) -> int | None:
    if node.op == "output":
        return last
    info = get_meta(node, STAGE)
    return info.stage if info else None


def _edges(gm: fx.GraphModule, num_stages: int, sizes: set, dims=None) -> list[Edge]:
    grad = needs_grad(gm)
    edges: list[Edge] = []
    for node in gm.graph.nodes:
        src = _stage_of(node, num_stages - 1)
        if src is None or node.op == "output" or node in sizes:
            continue
        dsts = sorted({_stage_of(u, num_stages - 1) for u in node.users} - {src})
        info = get_meta(node, TENSOR)
        for dst in dsts:
            assert dst > src, f"{node.name} flows backwards from stage {src} to {dst}"
            edges.append(Edge(len(edges), node.name, src, dst, tuple(info.shape), info.dtype, grad(node),
                              dims=(dims or {}).get(node.name)))
    return edges


def _size_inputs(nodes, sizes: set) -> set[fx.Node]:
    """The size nodes ``nodes`` read, and the size nodes and inputs those are computed from."""
    out, todo = set(), [a for n in nodes for a in n.all_input_nodes if a in sizes]
    while todo:
        node = todo.pop()
        if node not in out:
            out.add(node)
            todo.extend(node.all_input_nodes)
    return out


def _build_stage(gm: fx.GraphModule, stage: int, num_stages: int, edges: list[Edge], sizes: set) -> StageGraph:
    last = num_stages - 1
    graph = fx.Graph()
    attrs: dict[str, object] = {}
    env: dict[fx.Node, fx.Node] = {}
    mine = [n for n in gm.graph.nodes if _stage_of(n, last) == stage and n not in sizes]
    wanted = {a for n in mine for a in n.all_input_nodes} | _size_inputs(mine, sizes)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n in wanted]
    for ph in inputs:
        env[ph] = graph.placeholder(ph.name)
        env[ph].meta = dict(ph.meta)
    by_name = {n.name: n for n in gm.graph.nodes}
    recvs = [e for e in edges if e.dst == stage]
    for e in recvs:
        name = f"recv_{e.index}"
        attrs[name] = RecvActivation(edge=e.index, src_stage=e.src, dst_stage=stage, shape=e.shape,
                                     dtype=e.dtype, requires_grad=e.requires_grad, dims=e.dims)
        env[by_name[e.value]] = graph.call_module(name, ())
        env[by_name[e.value]].meta = {k: v for k, v in by_name[e.value].meta.items() if k == TENSOR}

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env and a in sizes:  # recomputed here from this stage's own inputs
            env[a] = graph.node_copy(a, lookup)
        if a not in env and a.op == "get_attr":
            env[a] = graph.get_attr(a.target)
            env[a].meta = dict(a.meta)
            attrs[a.target] = gm.get_parameter(a.target) if _is_param(gm, a.target) else _fetch(gm, a.target)
        return env[a]

    outputs = None
    for node in mine:
        if node.op == "output":
            outputs = fx.map_arg(node.args[0], lookup)
            continue
        env[node] = graph.node_copy(node, lookup)
        if node.op == "call_module":
            attrs[node.target] = gm.get_submodule(node.target)
    sends = [e for e in edges if e.src == stage]
    tokens = []
    for e in sends:
        name = f"send_{e.index}"
        attrs[name] = SendActivation(edge=e.index, src_stage=stage, dst_stage=e.dst, shape=e.shape,
                                     dtype=e.dtype, requires_grad=e.requires_grad, dims=e.dims)
        tokens.append(graph.call_module(name, (env[by_name[e.value]],)))
    graph.output(outputs if stage == last else tuple(tokens))
    stage_gm = fx.GraphModule(attrs, graph, class_name=f"Stage{stage}")
    params = tuple(n.target for n in graph.nodes if n.op == "get_attr" and _is_param(stage_gm, n.target))
    return StageGraph(stage=stage, gm=stage_gm, input_names=tuple(p.name for p in inputs),
                      param_names=params, sends=sends, recvs=recvs, is_last=stage == last)


def _fetch(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _is_param(gm, target: str) -> bool:
    return isinstance(_fetch(gm, target), torch.nn.Parameter)


def edge_values(gm: fx.GraphModule, num_stages: int) -> list[str]:
    """The names of the values that cross stages (what :func:`split_graph` sends)."""
    return sorted({e.value for e in _edges(gm, num_stages, size_nodes(gm))})


def split_pipeline(st: LoweringState) -> LoweringState:
    """``stages``: one graph per stage of the Plan (only ``st.only`` when given: then ``shared``, which stages
    read each parameter, is read off the whole graph first, as the stages built cannot tell). A graph with
    symbolic input dims (``st.captured.dynamic``) sends edges whose shapes follow them as SizeExprs
    (:func:`autopar.passes.frontend.symbolic_sizes.symbolic_shapes`), received per microbatch at its own sizes."""
    shared = param_stages(st.gm) if st.only is not None else None
    dynamic = tuple(st.captured.dynamic) if st.captured is not None else ()
    dims = None
    if dynamic and st.num_stages > 1:
        dims = symbolic_shapes(st.gm, st.example_args, dynamic, nodes=edge_values(st.gm, st.num_stages))
    stages = split_graph(st.gm, num_stages=st.num_stages, only=st.only, dims=dims, dynamic=dynamic)
    return dataclasses.replace(st, stages=tuple(stages), shared=shared)


def param_stages(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """{user name: stages reading it} of every parameter, read off the stage-assigned graph."""
    out = {}
    for node in gm.graph.nodes:
        info = get_meta(node, PARAM) if node.op == "get_attr" else None
        if info is None or not info.is_parameter:
            continue
        used = sorted({s.stage for u in node.users if (s := get_meta(u, STAGE)) is not None})
        out[user_name(node.target)] = tuple(used)
    return dict(sorted(out.items()))


def split_graph(gm: fx.GraphModule, *, num_stages: int, only=None, dims=None, dynamic=()) -> list[StageGraph]:
    """Split ``gm`` (every call node carrying ``autopar.stage``) into ``num_stages`` stage graphs.

    ``only``: build just these stages (one rank's program of a large plan); all when None.
    ``dims``: {value: shape with SizeExprs} of the edges whose shape follows a symbolic input dim;
    ``dynamic``: those dims (the captured graph's DynamicDims), given to every stage.
    """
    sizes = size_nodes(gm)
    edges = _edges(gm, num_stages, sizes, dims)
    stages = [_build_stage(gm, s, num_stages, edges, sizes) for s in range(num_stages) if only is None or s in only]
    for stage in stages:
        stage.dynamic = tuple(dynamic)
    return stages
