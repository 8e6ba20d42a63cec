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

from autopar.passes.meta_keys import MODULE, PARAM, Placement, get_meta
from autopar.passes.tp_rules import REPLICATE, NoRule, op_name, rule_for, shape_of

__all__ = ["TpRegion", "find_tp_regions", "is_param_linear"]

log = logging.getLogger(__name__)


@dataclass
class TpRegion:
    """One sharded region: its column and row linears and the placement of every node inside."""

    columns: list[fx.Node] = field(default_factory=list)
    rows: list[fx.Node] = field(default_factory=list)
    placements: dict[fx.Node, Placement] = field(default_factory=dict)

    def describe(self) -> str:
        def path(n):
            return get_meta(n, MODULE).path if get_meta(n, MODULE) else n.name
        return (f"columns={[path(n) for n in self.columns]} rows={[path(n) for n in self.rows]}")


def is_param_linear(node: fx.Node) -> bool:
    """A call to aten.linear whose weight is a parameter read by get_attr."""
    if node.op != "call_function" or op_name(node) != "linear":
        return False
    weight = node.args[1]
    return (isinstance(weight, fx.Node) and weight.op == "get_attr" and get_meta(weight, PARAM) is not None
            and len(weight.users) == 1 and len(get_meta(weight, PARAM).aliases) == 1)


def _seed_chunks(linear: fx.Node) -> int:
    """How many equal blocks a column output holds (a fused qkv split three ways -> 3)."""
    out_rank = len(shape_of(linear))
    for user in linear.users:
        if user.op == "call_function" and op_name(user) in ("split", "split_with_sizes", "chunk"):
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            if dim % out_rank == out_rank - 1:
                size = shape_of(linear)[-1]
                arg = user.args[1]
                return len(arg) if isinstance(arg, (list, tuple)) else (arg if op_name(user) == "chunk"
                                                                        else -(-size // arg))
    return 1


class _Defer(Exception):
    """A rule needs an input that propagation has not reached yet: retry the node later."""


class _Solver:
    def __init__(self, taken: set):
        self.region = TpRegion()
        self.queue: deque[fx.Node] = deque()
        self.taken = taken
        self.deferring = True

    def add_column(self, linear: fx.Node, placement: Placement) -> None:
        if linear in self.taken or not is_param_linear(linear):
            raise NoRule(f"{linear.name} cannot become column-parallel")
        if linear.args[0] in self.region.placements:
            raise NoRule(f"{linear.name} has a sharded input")
        if placement.dim != len(shape_of(linear)) - 1:
            raise NoRule(f"{linear.name} would be sharded on a non-feature dim")
        self.region.columns.append(linear)
        self.region.placements[linear] = placement
        self.queue.append(linear)

    def require(self, node: fx.Node, placement: Placement) -> None:
        have = self.region.placements.get(node)
        if have is not None:
            if have != placement:
                raise NoRule(f"{node.name} is {have}, needed {placement}")
            return
        if placement == REPLICATE:
            return
        if is_param_linear(node):
            return self.add_column(node, placement)
        self._require_backward(node, placement)

    def _require_backward(self, node: fx.Node, placement: Placement) -> None:
        """Pull a shard back through a shape op (view, transpose, getitem, split) to a linear."""
        if node.op != "call_function" or op_name(node) not in (
                "view", "reshape", "_unsafe_view", "transpose", "getitem", "split", "unsqueeze",
                "expand", "permute", "clone", "contiguous", "split_with_sizes", "chunk"):
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
        if is_param_linear(user) and user.args[0] is src and user.args[1] is not src:
            p = self.region.placements[src]
            if p.dim == len(shape_of(src)) - 1 and p.chunks == 1 and user not in self.taken:
                self.region.rows.append(user)
                self.region.placements[user] = Placement("P")
                return
            raise NoRule(f"{user.name} consumes {src.name} ({p}) but cannot be row-parallel")
        out, need = rule_for(user)(user, self.region.placements)
        if self.deferring and any(
                p != REPLICATE and n not in self.region.placements and not is_param_linear(n)
                for n, p in need.items()):
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


def _solve_from(seeds: list[fx.Node], taken: set) -> TpRegion:
    solver = _Solver(taken)
    for seed in seeds:
        solver.add_column(seed, Placement("S", len(shape_of(seed)) - 1, _seed_chunks(seed)))
    region = solver.solve()
    if not region.rows:
        raise NoRule("the shard never meets a row-parallel linear")
    return region


def find_tp_regions(gm: fx.GraphModule, *, skip=(), rejected: dict | None = None) -> list[TpRegion]:
    """Every region that shards cleanly, in graph order; failed candidates are logged and skipped.

    Linears in ``skip`` (an LM head the vocabulary pass shards) are neither columns nor rows.
    ``rejected``: a dict that receives {candidate node: why it stays replicated} (autopar.coverage).
    """
    regions: list[TpRegion] = []
    taken: set[fx.Node] = set(skip)
    for node in gm.graph.nodes:
        if node in taken or not is_param_linear(node):
            continue
        siblings = [u for u in node.args[0].users if is_param_linear(u) and u.args[0] is node.args[0]
                    and u not in taken] if isinstance(node.args[0], fx.Node) else [node]
        region = None
        for seeds in ([[node]] if len(siblings) <= 1 else [siblings, [node]]):
            try:
                region = _solve_from(seeds, taken)
                break
            except NoRule as why:
                path = get_meta(node, MODULE).path if get_meta(node, MODULE) else node.name
                reason = why
        if region is None:
            log.warning("tensor parallel: %s (node %s) stays replicated: %s", path, node.name, reason)
            if rejected is not None:
                rejected[node] = str(reason)
            continue
        regions.append(region)
        taken.update(region.columns)
        taken.update(region.rows)
    return regions
