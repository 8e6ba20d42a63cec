"""Find tensor-parallel regions by propagating shard placements from candidate linears.

A region starts at column-parallel linears (replicated input, weight sharded on its output dim)
and ends at row-parallel linears (sharded input, weight sharded on its input dim, partial-sum
output). Everything between is assigned a placement by the per-op rules of
:mod:`autopar.passes.tp.tp_rules`. The Megatron pattern -- attention heads split, MLP hidden split --
comes out of this propagation; nothing here knows what attention or an MLP is.
A candidate whose region needs an op with no rule, or lets a shard escape, is left replicated
with a warning that names the node and the reason.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.errors import ShardingError
from autopar.ir.meta_keys import MODULE, PARAM, TENSOR, Placement, get_meta
from autopar.passes.tp.tp_fused_blocks import SPLITS, broadcast_heads, split_pieces
from autopar.passes.tp.tp_gather_output import conv_of, gathered_placements
from autopar.passes.tp.tp_projection import Projection, is_param_linear, projection_of, seed_chunks
from autopar.passes.tp.tp_pullback_rules import broadcast_back, pull_back_rule
from autopar.passes.tp.tp_reduce_rules import read_replicated
from autopar.passes.tp.tp_rules import (ASSERTIONS, ELEMENTWISE, REPLICATE, NoRule, constant_value, op_name,
                                     rule_for, shape_of, slice_bounds, view_dim_map)

__all__ = ["Projection", "TpRegion", "find_tp_regions", "is_bottleneck", "is_param_linear", "projection_of"]

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
    # columns whose output is all-gathered (no row closes them: passes/tp/tp_gather_output.py)
    gathers: list[fx.Node] = field(default_factory=list)

    def describe(self) -> str:
        def path(n):
            return get_meta(n, MODULE).path if get_meta(n, MODULE) else n.name
        return (f"columns={[path(n) for n in self.columns]} rows={[path(n) for n in self.rows]}")


def grad_carriers(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value carries a gradient: floating (or complex) values computed from a parameter or a float input."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        info = get_meta(node, TENSOR)
        floating = info is not None and info.dtype is not None and (info.dtype.is_floating_point
                                                                    or info.dtype.is_complex)  # rotary as complex
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


def _where(node: fx.Node) -> str:
    info = get_meta(node, MODULE)
    return f"node {node.name} (module {info.path or '<root>'})" if info else f"node {node.name}"


class _Defer(Exception):
    """A rule needs an input that propagation has not reached yet: retry the node later."""


_SHAPE_OPS = ("view", "reshape", "_unsafe_view", "transpose", "getitem", "split", "unsqueeze", "expand",
              "permute", "clone", "contiguous", "split_with_sizes", "chunk", "t")


class NotDivisible(NoRule):
    """A shard that does not divide evenly over tp (kept apart: it becomes a ShardingError)."""

    def __init__(self, node: fx.Node, message: str):
        super().__init__(message)
        self.node = node


def _divisors(n: int) -> list[int]:
    return [d for d in range(n - 1, 0, -1) if n % d == 0]


def fits(node: fx.Node, p: Placement, tp_size: int | None) -> str | None:
    """Why ``p`` does not cut ``node`` evenly over ``tp_size`` ranks, or None when it does."""
    if tp_size is None or p.kind != "S" or node.op == "call_function" and op_name(node) in ASSERTIONS:
        return None
    return p.layout.misfit(shape_of(node), tp_size,
                           what=f"{op_name(node) if node.op == 'call_function' else node.op} output")


def _heads(node: fx.Node, dim: int, chunks: int, depth: int = 0) -> int | None:
    """The number of heads per block the feature dim ``dim`` of ``node`` is viewed into, if any."""
    if depth > 6:
        return None
    for user in node.users:
        if user.op != "call_function":
            continue
        name = op_name(user)
        if name in ("view", "reshape", "_unsafe_view", "unflatten") and user.args[0] is node:
            try:
                out_dim, out_chunks = view_dim_map(shape_of(node), shape_of(user), dim, chunks)
            except NoRule:
                continue
            in_shape, out_shape = shape_of(node), shape_of(user)
            if len(out_shape) > len(in_shape):
                if out_dim > 0 and out_shape[out_dim - 1] == 1 and \
                        math.prod(in_shape[:dim]) == math.prod(out_shape[:out_dim - 1]):
                    return 1  # a single head (multi-query): (..., features) -> (..., 1, head_dim)
                heads = out_shape[out_dim] // out_chunks
                # a later view may cut these heads again into groups (Falcon's (kv groups, queries + 2)
                # after (slots, head_dim)): the outermost factor is what the shards must follow
                groups = _heads(user, out_dim, out_chunks, depth + 1)
                return groups if groups is not None and groups < heads and heads % groups == 0 else heads
        elif name == "unsqueeze" and (found := broadcast_heads(node)) is not None:
            return found  # broadcast to its query heads (repeat_kv): its kv heads
        elif name in ELEMENTWISE and shape_of(user) == shape_of(node):  # a norm over every head before the split
            found = _heads(user, dim, chunks, depth + 1)
            if found is not None:
                return found
        elif name in ("split", "split_with_sizes", "chunk") and chunks > 1:
            for piece in user.users:
                found = _heads(piece, dim, 1, depth + 1)
                if found is not None:
                    return found
    return None


def seed_ways(seed: fx.Node, chunks: int, tp_size: int | None) -> int:
    """``parts`` for a column: 0 (cut tp ways), or the number of heads when fewer than tp (each
    replicated over tp / heads ranks, as Megatron-LM and vLLM replicate kv heads)."""
    if tp_size is None:
        return 0
    return _ways_of(_heads(seed, len(shape_of(seed)) - 1, chunks), tp_size)


_BLOCK_OPS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "slice", "index", "transpose", "permute", "unsqueeze", "t", "numpy_T",
              *SPLITS, "getitem", *ELEMENTWISE)


class _Solver:
    def __init__(self, taken: set, carriers: set, tp_size: int | None):
        self.region = TpRegion()
        self.queue: deque[fx.Node] = deque()
        self.taken = taken
        self.carriers = carriers
        self.tp_size = tp_size
        self.deferring = True

    def check(self, node: fx.Node, p: Placement) -> None:
        why = fits(node, p, self.tp_size)
        if why is not None:
            raise NotDivisible(node, why)

    def add_column(self, linear: fx.Node, placement: Placement) -> None:
        proj = projection_of(linear)
        if linear in self.taken or proj is None:
            raise NoRule(f"{linear.name} cannot become column-parallel")
        if proj.x in self.region.placements:
            raise NoRule(f"{linear.name} has a sharded input")
        if placement.dim != len(shape_of(linear)) - 1:
            raise NoRule(f"{linear.name} would be sharded on a non-feature dim")
        self.check(linear, placement)
        self.region.columns.append(linear)
        self.region.placements[linear] = placement
        self._place_weight(proj, placement.replace(dim=proj.out_dim))
        if proj.bias is not None:
            self.region.placements[proj.bias] = placement.replace(dim=0)
        self.queue.append(linear)

    def _place_weight(self, proj: Projection, weight: Placement) -> None:
        self.region.placements[proj.weight] = weight
        if proj.via is not None:
            self.region.placements[proj.via] = weight.replace(dim=1 - weight.dim)

    def add_row(self, user: fx.Node, proj: Projection) -> None:
        self.region.rows.append(user)
        self.region.placements[user] = Placement("P")
        self._place_weight(proj, Placement.shard(1 - proj.out_dim, 1))

    def require(self, node: fx.Node, placement: Placement) -> None:
        have = self.region.placements.get(node, self.region.local_slices.get(node))
        if have is not None:
            if have != placement and not read_replicated(node, have, placement):
                raise NoRule(f"{node.name} is {have}, needed {placement}")
            return
        self.check(node, placement)
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
        """Pull a shard back through a shape op (view, transpose, getitem, split) to a linear, or through
        an elementwise op or a table lookup (passes/tp/tp_pullback_rules.py)."""
        pull = pull_back_rule(node) if node.op == "call_function" and op_name(node) not in _SHAPE_OPS else None
        if pull is not None:
            for src, need in pull(node, placement).items():
                self.require(src, need)
            self.region.placements[node] = placement
            self.queue.append(node)
            return
        if node.op != "call_function" or op_name(node) not in _SHAPE_OPS:
            raise NoRule(f"{node.name} ({op_name(node) if node.op == 'call_function' else node.op}) "
                         f"would need to be {placement} but is computed replicated")
        src = node.args[0]
        for candidate in self._candidates(src, node):
            trial = dict(self.region.placements)
            trial[src] = candidate
            if fits(src, candidate, self.tp_size) is not None:
                continue
            try:
                out, _ = rule_for(node)(node, trial)
            except NoRule:
                continue
            if out == placement:
                self.require(src, candidate)
                self.region.placements[node] = placement
                self.queue.append(node)
                return
        if op_name(node) in ("expand", "broadcast_to"):  # no input shard gives it: broadcast a whole input
            for src, need in broadcast_back(node, placement).items():
                self.require(src, need)
            self.region.placements[node] = placement
            self.queue.append(node)
            return
        raise NoRule(f"cannot derive {placement} for {node.name} from its input")

    def _candidates(self, src: fx.Node, node: fx.Node):
        if src in self.region.placements:
            return [self.region.placements[src]]
        if op_name(node) == "getitem":  # a piece of a split: the split sharded alike on another dim
            if src.op != "call_function" or op_name(src) not in SPLITS:
                return []
            rank = len(shape_of(node))
        else:
            rank = len(shape_of(src)) if not isinstance(get_meta(src, "autopar.tensor"), type(None)) else 0
        ways = [0] + (_divisors(self.tp_size) if self.tp_size else [])
        plain = [Placement.shard(d, c, w) for w in ways for d in range(rank) for c in (1, 2, 3, 4)]
        return plain + [Placement.shard(d, 1, w, d + 1) for w in ways[1:] for d in range(rank - 1)]

    def visit_user(self, user: fx.Node, src: fx.Node) -> None:
        if user.op == "output":
            raise NoRule(f"sharded value {src.name} reaches the graph output")
        if user in self.region.placements:
            return
        proj = projection_of(user)
        if proj is not None and proj.x is src and proj.weight is not src:
            p = self.region.placements[src]
            if p.dim == len(shape_of(src)) - 1 and p.chunks == 1 and not p.parts and not p.blocks \
                    and user not in self.taken:
                return self.add_row(user, proj)
            raise NoRule(f"{user.name} consumes {src.name} ({p}) but cannot be row-parallel")
        if op_name(user) not in ("view", "reshape", "_unsafe_view", "flatten", "unflatten") and any(
                self.region.placements.get(a, REPLICATE).inner is not None for a in user.all_input_nodes):
            raise NoRule(f"{user.name} reads a kv-head broadcast before it is merged with the query heads")
        if op_name(user) not in _BLOCK_OPS and any(
                self.region.placements.get(a, REPLICATE).blocks for a in user.all_input_nodes):
            raise NoRule(f"{user.name} ({op_name(user)}) reads the unequal blocks of a fused projection")
        out, need = rule_for(user)(user, self.region.placements)
        self.check(user, out)
        if self.deferring and any(
                p != REPLICATE and n not in self.region.placements and not is_param_linear(n)
                and n in self.carriers and n.op != "get_attr" for n, p in need.items()):
            raise _Defer(user)
        self.region.placements[user] = out
        for node, placement in need.items():
            self.require(node, placement)
        if out.kind != "P":  # a partial sum (passes/tp/tp_reduce_rules.py) is all-reduced: read replicated
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


def _ways_of(heads: int | None, tp_size: int | None) -> int:
    if tp_size is None or heads is None or heads % tp_size == 0 or tp_size % heads != 0:
        return 0
    return heads


def _pieces(node: fx.Node, dim: int) -> list[tuple[int, int, fx.Node]]:
    """(start, stop, reader) of the slices (and constant single-index reads) of ``node`` along ``dim``."""
    pieces = []
    for user in node.users:
        if user.op != "call_function" or user.args[0] is not node:
            continue
        if op_name(user) == "slice":
            d, start, stop = slice_bounds(user)
            if d == dim and (len(user.args) < 5 or user.args[4] == 1):
                pieces.append((start, stop, user))
        elif op_name(user) == "index" and len(user.args[1]) == dim + 1 and all(
                t is None for t in user.args[1][:dim]):
            value = constant_value(user.args[1][dim]) if isinstance(user.args[1][dim], fx.Node) else None
            if value is not None and value.numel() == 1:
                at = int(value) % shape_of(node)[dim]
                pieces.append((at, at + 1, user))
    pieces += split_pieces(node, dim)  # a split into unequal sizes (GPT-BigCode's [q | k | v])
    return sorted(pieces, key=lambda t: t[:2])


def _seed_blocks(seed: fx.Node, tp_size: int | None) -> tuple[tuple[int, int], ...]:
    """Unequal blocks of a fused projection, read by slices of its feature dim (Phi-3's [q | k | v]) or of
    the heads dim it is viewed into (Falcon's multi-query [q heads | k | v])."""
    dim = len(shape_of(seed)) - 1
    size = shape_of(seed)[dim]
    candidates = [(seed, dim, 1, None)]
    for user in seed.users:
        if user.op == "call_function" and op_name(user) in ("view", "reshape", "_unsafe_view"):
            out = shape_of(user)
            if len(out) == len(shape_of(seed)) + 1 and out[dim] * out[dim + 1] == size:
                candidates.append((user, dim, out[dim + 1], 1))
        elif user.op == "call_function" and op_name(user) == "unsqueeze" and shape_of(user)[-1] == size:
            candidates.append((user, dim + 1, 1, None))  # a heads dim made before the blocks are split
    for node, d, unit, heads_per in candidates:
        pieces = _pieces(node, d)
        if len(pieces) < 2 or pieces[0][0] != 0 or pieces[-1][1] != shape_of(node)[d] or any(
                a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
            continue
        return tuple(((stop - start) * unit, _ways_of((stop - start) if heads_per else _heads(n, d, 1), tp_size))
                     for start, stop, n in pieces)
    return ()


def seed_placement(seed: fx.Node, tp_size: int | None) -> Placement:
    """A column's output placement: its feature dim, cut as its heads and blocks allow."""
    dim = len(shape_of(seed)) - 1
    blocks = _seed_blocks(seed, tp_size)
    if blocks:
        return Placement.shard(dim, blocks=blocks)
    chunks = seed_chunks(seed)
    return Placement.shard(dim, chunks, seed_ways(seed, chunks, tp_size))


def _solve_from(seeds: list[fx.Node], taken: set, carriers: set, tp_size: int | None) -> TpRegion:
    solver = _Solver(taken, carriers, tp_size)
    for seed in seeds:
        solver.add_column(seed, seed_placement(seed, tp_size))
    region = solver.solve()
    if not region.rows:
        raise NoRule("the shard never meets a row-parallel linear")
    region.replicated_inputs -= set(region.placements)
    return region


def _solves_undivided(node: fx.Node, siblings: list, taken: set, carriers: set) -> bool:
    """Whether the region would shard but for tp not dividing it (then that is the user's error to fix)."""
    for seeds in ([[node]] if len(siblings) <= 1 else [siblings, [node]]):
        try:
            _solve_from(seeds, taken, carriers, None)
            return True
        except NoRule:
            continue
    return False


def find_tp_regions(gm: fx.GraphModule, *, skip=(), tp_size: int | None = None,
                    rejected: dict | None = None) -> list[TpRegion]:
    """Every region that shards cleanly, in graph order; failed candidates are logged and skipped.

    Linears in ``skip`` (an LM head the vocabulary pass shards) are neither columns nor rows.
    ``tp_size``: choose shards that divide evenly over that many ranks (fewer kv heads than tp
    replicated over tp / kv ranks); a region no choice divides raises :class:`ShardingError`.
    ``rejected``: a dict that receives {candidate node: why it stays replicated} (autopar.coverage).

    A low-rank bottleneck (:func:`is_bottleneck`: a down-projection whose region closes at an
    up-projection, ``x (d) -> r -> d'`` with ``r`` below both) is tried last: sharding its rank would
    all-reduce the wide output, where the up-projection can open a region of its own and be split by
    heads (DeepSeek's q and kv down-projections stay replicated, as Megatron-Core keeps them). Taken
    only if nothing else takes its linears.
    """
    regions: list[TpRegion] = []
    taken: set[fx.Node] = set(skip)
    carriers = grad_carriers(gm)
    later: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node not in taken and _candidate(gm, node, regions, taken, carriers, tp_size, rejected, defer=True):
            later.append(node)
    for node in later:
        if node not in taken:
            _candidate(gm, node, regions, taken, carriers, tp_size, rejected, defer=False)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(regions, key=lambda r: order[r.columns[0]])


def is_bottleneck(region: TpRegion) -> bool:
    """Whether every column of ``region`` narrows its input and every row widens it (a low-rank factor pair)."""
    def width(node: fx.Node, proj: Projection) -> tuple[int, int]:
        return shape_of(proj.x)[-1], shape_of(node)[-1]
    if region.gathers or not region.rows:
        return False
    columns = [width(n, projection_of(n)) for n in region.columns]
    rows = [width(n, projection_of(n)) for n in region.rows]
    return all(o < i for i, o in columns) and all(o > i for i, o in rows)


def _candidate(gm, node: fx.Node, regions: list, taken: set, carriers: set, tp_size, rejected,
               *, defer: bool) -> bool:
    """Open a region at candidate ``node`` (or record why it stays replicated); True when it is a
    bottleneck put off until every other candidate had its turn (``defer``)."""
    proj = projection_of(node)
    if proj is None:
        if conv_of(node) is not None:
            _add_gathered(regions, taken, node, tp_size, rejected)
        return False
    siblings = [u for u in proj.x.users if (q := projection_of(u)) is not None and q.x is proj.x
                and u not in taken]
    region = None
    path = get_meta(node, MODULE).path if get_meta(node, MODULE) else node.name
    for seeds in ([[node]] if len(siblings) <= 1 else [siblings, [node]]):
        try:
            region = _solve_from(seeds, taken, carriers, tp_size)
            break
        except NoRule as why:
            reason = why
    if region is not None and defer and is_bottleneck(region):
        return True
    if region is None and isinstance(reason, NotDivisible) and _solves_undivided(node, siblings, taken, carriers):
        raise ShardingError(str(reason), where=_where(reason.node),
                            fix="choose a tp degree that divides the attention heads, kv heads and hidden sizes "
                                "(mesh dim 'tp'), or set tp=1")
    if region is None:
        if not defer:  # a bottleneck whose up-projection opened a region of its own
            i, o = shape_of(proj.x)[-1], shape_of(node)[-1]
            reason = (f"a low-rank down-projection ({i} -> {o}) kept whole: its up-projection is split instead "
                      f"({reason})")
        _add_gathered(regions, taken, node, tp_size, rejected, reason=reason, path=path)
        return False
    regions.append(region)
    taken.update(region.columns)
    taken.update(region.rows)
    return False


def _add_gathered(regions: list, taken: set, node: fx.Node, tp_size: int | None, rejected: dict | None,
                  reason="a convolution's output channels do not divide by tp", path: str = "") -> None:
    """A column with a gathered output at ``node`` (passes/tp/tp_gather_output.py), or log why it stays replicated."""
    placed = gathered_placements(node, tp_size=tp_size)
    if placed is None:
        log.warning("tensor parallel: %s (node %s) stays replicated: %s", path or node.name, node.name, reason)
        if rejected is not None:
            rejected[node] = str(reason)
        return
    regions.append(TpRegion(columns=[node], placements=placed, gathers=[node]))
    taken.add(node)
