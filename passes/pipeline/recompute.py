"""Activation recomputation as a graph pass: wrap each block's nodes in a checkpointed call node.

``apply_recompute(gm, mode=...)`` rewrites one stage graph. Each *region* of nodes is moved into
its own GraphModule, owned by a :class:`~autopar.ops.recompute.Recompute` module and called from the stage graph as one
visible ``call_module`` node (``recompute_0(...)``) followed by ``getitem``s. The module runs
its body through ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved), so autograd
keeps only what the mode says and recomputes the rest in backward.

Modes, and the exact rule each one follows:

- ``"none"``: the graph is unchanged.
- ``"full"``: one region per pipeline block (a unit such as ``model.blocks.3``). Only the block's
  inputs are kept; the whole block, tensor-parallel collectives included, runs again in backward
  (a forward all-reduce inside the block is repeated, as in Megatron's full recompute; torch's
  early stop skips whatever comes after the last tensor backward needs).
- ``"selective"``: the same blocks, cut at every collective that communicates in forward (``g``:
  ``TpReduce``; sequence-parallel gathers/scatters), so communication is never repeated. Inside a
  region, the outputs of the ops in :data:`~autopar.ops.recompute.SAVED_OPS` (matmuls and fused attention, the expensive
  ones, as Megatron's selective recompute keeps the linears' outputs) are stored; every other op
  (normalisations, activations, elementwise, views, softmax, rotary) is recomputed from them.
  This is torch's selective activation checkpointing with an op policy.

Regions never contain p2p nodes (send/recv stay in the stage graph, so a transfer is never
repeated) and never contain ``get_attr``: parameters and buffers are passed into the region as
arguments, so the runtime's parameter handling (copies, tied weights, ZeRO) is unchanged. Nodes
that read only parameters or buffers (a rotary table slice, a split-backward weight alias) stay
outside too.

Example::

    >>> import autopar
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> result = autopar.plan(model, (1, 2, 1), example_inputs=(x,), loss_fn=loss_fn, example_target=y)
    >>> stage = result.ranks[1].stages[0]      # the last of two stages: it receives, runs block 1
    >>> gm = apply_recompute(stage.gm, mode="full")
    >>> [n.target for n in gm.graph.nodes if n.op == "call_module"]
    ['recv_0', 'recompute_0']
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch.fx as fx

from autopar.errors import PassError, PlanError
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.ops.collectives import GraphCollective, TpCopy, TpScatter
from autopar.ops.p2p import P2PNode
from autopar.ops.recompute import Recompute
from autopar.passes.lowering_state import LoweringState

__all__ = ["RECOMPUTE_MODES", "apply_recompute", "recompute_regions", "check_mode", "recompute_modes",
           "recompute_stage", "recompute"]

RECOMPUTE_MODES = ("none", "selective", "full")
_BLOCK = re.compile(r"\.\d+$")

def check_mode(mode: str, *, where: str) -> str:
    """``mode`` if it is a known recompute mode, else a PlanError naming the choices."""
    if mode not in RECOMPUTE_MODES:
        raise PlanError(f"unknown recompute mode {mode!r}", where=where,
                        fix=f"use one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def _is_p2p(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), P2PNode)


def _communicates_forward(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Does this node run a collective in its forward? (TpCopy does not: identity forward.)"""
    if node.op != "call_module":
        return False
    module = gm.get_submodule(node.target)
    comm = getattr(module, "comm", None)
    if comm is not None:
        return any(c.direction == "forward" for c in comm(1, 1))
    return isinstance(module, GraphCollective) and not isinstance(module, (TpCopy, TpScatter))


def _param_only(node: fx.Node) -> bool:
    """A node that reads only parameters/buffers (no activation): it stays outside regions."""
    inputs = node.all_input_nodes
    return bool(inputs) and all(a.op == "get_attr" or _param_only(a) for a in inputs)


def _block_of(node: fx.Node) -> str | None:
    info = get_meta(node, MODULE)
    return info.unit if info is not None and _BLOCK.search(info.unit or "") else None


def recompute_regions(gm: fx.GraphModule, *, mode: str) -> list[list[fx.Node]]:
    """The node runs ``mode`` recomputes: maximal runs of one block's call nodes, in graph order."""
    check_mode(mode, where="recompute mode")
    if mode == "none":
        return []
    regions: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    unit = None
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module", "call_method") or _param_only(node):
            continue
        block = None if _is_p2p(gm, node) else _block_of(node)
        cut = mode == "selective" and _communicates_forward(gm, node)
        if block is None or block != unit or cut:
            if current:
                regions.append(current)
            current, unit = [], block
        if block is not None and not cut:
            current.append(node)
    if current:
        regions.append(current)
    return [r for r in regions if any(n.target is not operator.getitem for n in r)]


def _outline(gm: fx.GraphModule, region: list[fx.Node], index: int, mode: str) -> None:
    """Move ``region`` into a Recompute submodule called by one node of ``gm``."""
    members = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        for a in node.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in region if any(u not in members for u in n.users)]
    body = fx.Graph()
    env = {a: body.placeholder(a.name) for a in inputs}
    for a in inputs:
        env[a].meta = dict(a.meta)
    owners = {}
    for node in region:
        env[node] = body.node_copy(node, lambda a: env[a])
        if node.op == "call_module":
            owners[node.target] = gm.get_submodule(node.target)
    body.output(tuple(env[n] for n in outputs))
    name = f"recompute_{index}"
    gm.add_submodule(name, Recompute(fx.GraphModule(owners, body, class_name=f"Region{index}"), mode=mode))
    with gm.graph.inserting_after(region[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta = {k: v for k, v in region[0].meta.items() if k == MODULE}
    with gm.graph.inserting_after(call):
        for i, node in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = dict(node.meta)
            node.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
    for node in reversed(region):
        gm.graph.erase_node(node)


def apply_recompute(gm: fx.GraphModule, *, mode: str) -> fx.GraphModule:
    """Rewrite ``gm`` so each region of ``mode`` runs checkpointed (in place; returns ``gm``)."""
    regions = recompute_regions(gm, mode=mode)
    for region in regions:
        bad = [n.name for n in region if _is_p2p(gm, n)]
        if bad:
            raise PassError(f"a recompute region would contain the p2p nodes {bad}", where=f"graph {type(gm).__name__}",
                            fix="report this graph to the autopar developers; use recompute='none'")
    for i, region in enumerate(regions):
        _outline(gm, region, i, mode)
    used = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    for name, child in list(gm.named_children()):
        if name not in used and isinstance(child, GraphCollective):
            delattr(gm, name)  # a collective that moved into a region's body
    gm.graph.lint()
    gm.recompile()
    return gm


def recompute_modes(planned: tuple[str, ...], requested: str, num_stages: int) -> tuple[str, ...]:
    """One mode per stage: the Plan's when it names them, else ``requested`` on every stage."""
    modes = tuple(planned) if planned else (requested,) * num_stages
    for i, mode in enumerate(modes):
        check_mode(mode, where=f"recompute mode of stage {i}")
    return modes


def recompute(st: LoweringState) -> LoweringState:
    """Every stage graph with its Plan mode's recompute regions (a stage's mode: the Plan's per stage)."""
    modes, n = st.plan.recompute, st.num_stages
    return dataclasses.replace(st, stages=tuple(recompute_stage(g, mode=modes[g.stage % n]) for g in st.stages))


def recompute_stage(stage, *, mode: str):
    """Apply :func:`apply_recompute` to a StageGraph's graph; returns the stage."""
    if mode != "none":
        apply_recompute(stage.gm, mode=mode)
    return stage
