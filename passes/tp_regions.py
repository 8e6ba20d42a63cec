"""Find tensor-parallel regions by propagating shard placements from candidate linears.

A region starts at column-parallel linears (replicated input, weight sharded on its output dim)
and ends at row-parallel linears (sharded input, weight sharded on its input dim, partial-sum
output). Everything between is assigned a placement by the per-op rules of
:mod:`autopar.passes.tp_rules`. The Megatron pattern -- attention heads split, MLP hidden split --
comes out of this propagation; nothing here knows what attention or an MLP is.
A candidate whose region needs an op with no rule, or lets a shard escape, is left replicated
with a warning that names the node and the reason.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.passes.meta_keys import MODULE, PARAM, TENSOR, Placement, get_meta
from autopar.passes.tp_rules import REPLICATE, NoRule, op_name, rule_for, shape_of

__all__ = ["Projection", "TpRegion", "find_tp_regions", "is_param_linear", "projection_of"]

log = logging.getLogger(__name__)


@dataclass
class TpRegion:
    """One sharded region: its column and row linears and the placement of every node inside."""

    columns: list[fx.Node] = field(default_factory=list)
    rows: list[fx.Node] = field(default_factory=list)
    placements: dict[fx.Node, Placement] = field(default_factory=dict)
    # values computed outside the region that carry a gradient and are read inside it replicated:
    # each rank's gradient of them is partial (its heads only), so they enter through an f
    replicated_inputs: set[fx.Node] = field(default_factory=set)
    # values without a gradient (masks, ALiBi slopes, constants) needed sharded: each rank slices its own
    local_slices: dict[fx.Node, Placement] = field(default_factory=dict)

    def describe(self) -> str:
        def path(n):
            return get_meta(n, MODULE).path if get_meta(n, MODULE) else n.name
        return (f"columns={[path(n) for n in self.columns]} rows={[path(n) for n in self.rows]}")


@dataclass(frozen=True)
class Projection:
    """``x @ W^T (+ b)`` with ``W`` a parameter, however the op spells it.

    ``out_dim`` is the weight dim that indexes output features: 0 for ``aten.linear`` and a weight
    read through ``t`` (Falcon's ``x @ W.T``), 1 for a weight stored (in, out) (``addmm``/``mm``/
    ``matmul``, transformers' ``Conv1D``). ``via`` is the transpose node between parameter and op.
    """

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    out_dim: int
    via: fx.Node | None = None


def _param_read(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    info = get_meta(node, PARAM)
    return info is not None and info.is_parameter and len(node.users) == 1 and len(info.aliases) == 1


def _weight(w) -> tuple[fx.Node, fx.Node | None, bool] | None:
    """(parameter, transpose node, transposed?) of a 2-D weight operand, or None."""
    if _param_read(w):
        return (w, None, False) if len(shape_of(w)) == 2 else None
    if (isinstance(w, fx.Node) and w.op == "call_function" and len(w.users) == 1 and _param_read(w.args[0])
            and len(shape_of(w.args[0])) == 2):
        name = op_name(w)
        if name in ("t", "numpy_T") or (name == "transpose" and sorted(d % 2 for d in w.args[1:3]) == [0, 1]) or (
                name == "permute" and [d % 2 for d in w.args[1]] == [1, 0]):
            return w.args[0], w, True
    return None


def projection_of(node: fx.Node) -> Projection | None:
    """The projection ``node`` computes, or None (see :class:`Projection`)."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    if name == "linear" and _param_read(node.args[1]) and isinstance(node.args[0], fx.Node):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None and not _param_read(bias):
            return None
        return Projection(node, node.args[0], node.args[1], bias, 0)
    if name in ("addmm", "mm", "matmul") and not node.kwargs:
        x, w = (node.args[1], node.args[2]) if name == "addmm" else node.args[:2]
        found = _weight(w)
        bias = node.args[0] if name == "addmm" else None
        if found is None or not isinstance(x, fx.Node) or (bias is not None and not (
                _param_read(bias) and len(shape_of(bias)) == 1)):
            return None
        weight, via, transposed = found
        return Projection(node, x, weight, bias, 0 if transposed else 1, via)
    return None


def is_param_linear(node: fx.Node) -> bool:
    """A projection (:func:`projection_of`): ``aten.linear``, ``addmm``, ``mm`` or ``matmul`` with a parameter."""
    return projection_of(node) is not None


def _seed_chunks(linear: fx.Node) -> int:
    """How many equal blocks a column output holds (a fused qkv split three ways -> 3).

    Looks through views that keep the feature dim last (``Conv1D``'s ``addmm`` output is viewed
    back to (batch, seq, features) before its split).
    """
    out_rank = len(shape_of(linear))
    size = shape_of(linear)[-1]
    for user in linear.users:
        if user.op != "call_function":
            continue
        name = op_name(user)
        if name in ("view", "reshape", "_unsafe_view") and shape_of(user) and shape_of(user)[-1] == size:
            found = _seed_chunks(user)
            if found > 1:
                return found
        if name in ("split", "split_with_sizes", "chunk"):
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % out_rank == out_rank - 1:
                arg = user.args[1]
                return len(arg) if isinstance(arg, (list, tuple)) else (arg if name == "chunk"
                                                                        else -(-size // arg))
    return 1


def grad_carriers(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value carries a gradient: floating values computed from a parameter or a float input."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        info = get_meta(node, TENSOR)
        floating = info is not None and info.dtype is not None and info.dtype.is_floating_point
        if node.op == "get_attr":
            param = get_meta(node, PARAM)
            if floating and param is not None and param.is_parameter:
                out.add(node)
        elif node.op == "placeholder":
            if floating:
                out.add(node)
        elif node.op in ("call_function", "call_module", "call_method"):
            if any(a in out for a in node.all_input_nodes) and (floating or info is None):
                out.add(node)
    return out


class _Defer(Exception):
    """A rule needs an input that propagation has not reached yet: retry the node later."""


_SHAPE_OPS = ("view", "reshape", "_unsafe_view", "transpose", "getitem", "split", "unsqueeze", "expand",
              "permute", "clone", "contiguous", "split_with_sizes", "chunk", "t")


class _Solver:
    def __init__(self, taken: set, carriers: set):
        self.region = TpRegion()
        self.queue: deque[fx.Node] = deque()
        self.taken = taken
        self.carriers = carriers
        self.deferring = True

    def add_column(self, linear: fx.Node, placement: Placement) -> None:
        proj = projection_of(linear)
        if linear in self.taken or proj is None:
            raise NoRule(f"{linear.name} cannot become column-parallel")
        if proj.x in self.region.placements:
            raise NoRule(f"{linear.name} has a sharded input")
        if placement.dim != len(shape_of(linear)) - 1:
            raise NoRule(f"{linear.name} would be sharded on a non-feature dim")
        self.region.columns.append(linear)
        self.region.placements[linear] = placement
        self._place_weight(proj, Placement("S", proj.out_dim, placement.chunks))
        if proj.bias is not None:
            self.region.placements[proj.bias] = Placement("S", 0, placement.chunks)
        self.queue.append(linear)

    def _place_weight(self, proj: Projection, weight: Placement) -> None:
        self.region.placements[proj.weight] = weight
        if proj.via is not None:
            self.region.placements[proj.via] = Placement("S", 1 - weight.dim, weight.chunks)

    def add_row(self, user: fx.Node, proj: Projection) -> None:
        self.region.rows.append(user)
        self.region.placements[user] = Placement("P")
        self._place_weight(proj, Placement("S", 1 - proj.out_dim, 1))

    def require(self, node: fx.Node, placement: Placement) -> None:
        have = self.region.placements.get(node, self.region.local_slices.get(node))
        if have is not None:
            if have != placement:
                raise NoRule(f"{node.name} is {have}, needed {placement}")
            return
        if placement == REPLICATE:
            if node in self.carriers:
                self.region.replicated_inputs.add(node)
            return
        if is_param_linear(node):
            return self.add_column(node, placement)
        if node.op == "get_attr" and node in self.carriers:
            return self._shard_param(node, placement)
        if node not in self.carriers:
            self.region.local_slices[node] = placement  # no gradient: each rank cuts its own slice
            return
        self._require_backward(node, placement)

    def _shard_param(self, node: fx.Node, placement: Placement) -> None:
        """A parameter read where a shard is needed (a bias added after ``x @ W.T``): hold that shard."""
        info = get_meta(node, PARAM)
        if len(info.aliases) != 1 or len(node.users) != 1:
            raise NoRule(f"parameter {info.name} is needed as {placement} but is also read elsewhere")
        self.region.placements[node] = placement

    def _require_backward(self, node: fx.Node, placement: Placement) -> None:
        """Pull a shard back through a shape op (view, transpose, getitem, split) to a linear."""
        if node.op != "call_function" or op_name(node) not in _SHAPE_OPS:
            raise NoRule(f"{node.name} ({op_name(node) if node.op == 'call_function' else node.op}) "
                         f"would need to be {placement} but is computed replicated")
        src = node.args[0]
        for candidate in self._candidates(src, node):
            trial = dict(self.region.placements)
            trial[src] = candidate
            try:
                out, _ = rule_for(node)(node, trial)
            except NoRule:
                continue
            if out == placement:
                self.require(src, candidate)
                self.region.placements[node] = placement
                self.queue.append(node)
                return
        raise NoRule(f"cannot derive {placement} for {node.name} from its input")

    def _candidates(self, src: fx.Node, node: fx.Node):
        if src in self.region.placements:
            return [self.region.placements[src]]
        if op_name(node) == "getitem":
            return []
        rank = len(shape_of(src)) if not isinstance(get_meta(src, "autopar.tensor"), type(None)) else 0
        return [Placement("S", d, c) for d in range(rank) for c in (1, 2, 3, 4)]

    def visit_user(self, user: fx.Node, src: fx.Node) -> None:
        if user.op == "output":
            raise NoRule(f"sharded value {src.name} reaches the graph output")
        if user in self.region.placements:
            return
        proj = projection_of(user)
        if proj is not None and proj.x is src and proj.weight is not src:
            p = self.region.placements[src]
            if p.dim == len(shape_of(src)) - 1 and p.chunks == 1 and user not in self.taken:
                return self.add_row(user, proj)
            raise NoRule(f"{user.name} consumes {src.name} ({p}) but cannot be row-parallel")
        out, need = rule_for(user)(user, self.region.placements)
        if self.deferring and any(
                p != REPLICATE and n not in self.region.placements and not is_param_linear(n)
                and n in self.carriers and n.op != "get_attr" for n, p in need.items()):
            raise _Defer(user)
        self.region.placements[user] = out
        for node, placement in need.items():
            self.require(node, placement)
        self.queue.append(user)

    def solve(self) -> TpRegion:
        deferred: list[tuple[fx.Node, fx.Node]] = []
        while True:
            while self.queue:
                node = self.queue.popleft()
                for user in list(node.users):
                    self._try_visit(user, node, deferred)
            if not deferred:
                return self.region
            retry, deferred = deferred, []
            before = len(self.region.placements)
            for user, src in retry:
                self._try_visit(user, src, deferred)
            if len(self.region.placements) == before and not self.queue:
                self.deferring = False  # no progress: pull shards back through shape ops, or fail
                for user, src in deferred:
                    self.visit_user(user, src)
                deferred = []

    def _try_visit(self, user: fx.Node, src: fx.Node, deferred: list) -> None:
        try:
            self.visit_user(user, src)
        except _Defer:
            deferred.append((user, src))


def _solve_from(seeds: list[fx.Node], taken: set, carriers: set) -> TpRegion:
    solver = _Solver(taken, carriers)
    for seed in seeds:
        solver.add_column(seed, Placement("S", len(shape_of(seed)) - 1, _seed_chunks(seed)))
    region = solver.solve()
    if not region.rows:
        raise NoRule("the shard never meets a row-parallel linear")
    region.replicated_inputs -= set(region.placements)
    return region


def find_tp_regions(gm: fx.GraphModule, *, skip=()) -> list[TpRegion]:
    """Every region that shards cleanly, in graph order; failed candidates are logged and skipped.

    Linears in ``skip`` (an LM head the vocabulary pass shards) are neither columns nor rows.
    """
    regions: list[TpRegion] = []
    taken: set[fx.Node] = set(skip)
    carriers = grad_carriers(gm)
    for node in gm.graph.nodes:
        proj = projection_of(node) if node not in taken else None
        if proj is None:
            continue
        siblings = [u for u in proj.x.users if (q := projection_of(u)) is not None and q.x is proj.x
                    and u not in taken]
        region = None
        for seeds in ([[node]] if len(siblings) <= 1 else [siblings, [node]]):
            try:
                region = _solve_from(seeds, taken, carriers)
                break
            except NoRule as why:
                path = get_meta(node, MODULE).path if get_meta(node, MODULE) else node.name
                reason = why
        if region is None:
            log.warning("tensor parallel: %s (node %s) stays replicated: %s", path, node.name, reason)
            continue
        regions.append(region)
        taken.update(region.columns)
        taken.update(region.rows)
    return regions
