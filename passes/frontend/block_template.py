"""Identical blocks captured once: capture a few blocks of a long ModuleList, then repeat the last one.

An 80-layer model is 80 copies of one block. Capturing, analysing and sharding all of them costs
80 times what one costs (torch.export of a 70B-shaped Llama: about 25 CPU seconds), though every
copy comes out the same. :func:`find_block_template` finds the longest ``nn.ModuleList`` of
identical blocks (same class, parameter and buffer shapes, plain attributes, no hooks, no weights
shared between blocks); the model is then captured with only its first :data:`CAPTURED` blocks
(:meth:`BlockTemplate.truncated`), analysed and sharded as usual, and :meth:`BlockTemplate.repeat`
stamps the last captured block out for the remaining ones: the same nodes with the block index in
their module paths and weight names changed, reading block ``j``'s own weights (sharded with the
template's :class:`~autopar.ir.shard_layout.ShardLayout`; MoE expert tensors split over ep keep
this ep rank's experts first, as :mod:`autopar.passes.moe.moe_expert_parallel` cut the template's),
their inputs wired to block ``j - 1``'s outputs, and the code after the blocks reading the last
block. Node metadata (shapes, FLOPs, placements) is copied, so nothing is propagated again.

The result is the graph a full capture gives, node for node (``tests/passes/test_block_template.py``
compares both). When the captured graph does not show the regular structure (code between the
blocks, a block reading an older block, blocks that differ), :func:`capture_blocks` falls back to
capturing every block and says why in the log.

Example::

    >>> import torch
    >>> from autopar.models import build_model
    >>> from autopar.passes.frontend.capture import capture
    >>> model = build_model("gpt_tiny", num_layers=6)
    >>> args = (torch.zeros(2, 16, dtype=torch.long),)
    >>> template = find_block_template(model, mode="once")
    >>> captured, template = capture_blocks(template, lambda: capture(model, args))
    >>> gm = template.repeat(captured.gm, tp_rank=0, tp_size=1, specs={})   # every block present
    >>> sorted({n.target.split(".")[2] for n in gm.graph.nodes if n.op == "get_attr" and ".blocks." in n.target})
    ['0', '1', '2', '3', '4', '5']
"""
from __future__ import annotations

import copy
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import PassError
from autopar.ir.graph_names import MODEL_PREFIX
from autopar.ir.meta_keys import MODULE, PARAM, ModuleInfo, get_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.passes.lowering_state import LoweringState

__all__ = ["CAPTURED", "MIN_BLOCKS", "BlockTemplate", "find_block_template", "capture_blocks", "repeat_blocks"]

log = logging.getLogger(__name__)

CAPTURED = 3  # blocks captured: block 2 is the template, checked against block 1
MIN_BLOCKS = 8  # "auto" repeats blocks only for lists at least this long (on the meta device)
_CALLS = ("call_function", "call_module", "call_method")
_SIMPLE = (int, float, bool, str, type(None))


def _plain_attrs(module: nn.Module) -> dict:
    """A module's plain Python attributes (numbers, strings, tuples of them)."""
    out = {}
    for key, value in vars(module).items():
        if key.startswith("_"):
            continue
        if isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)):
            out[key] = value
    return out


_POSITION = "<the block's index>"


def _signature(block: nn.Module, positions=frozenset()) -> tuple:
    """What must agree between two blocks for one to stand for the other.

    ``positions``: (module path, attribute) pairs that hold the block's own index in its list in every
    block (transformers' ``layer_idx``, which indexes a cache): the block's position, not a difference.
    A block whose code computes with it gives another graph than its neighbour, which the check of
    the captured blocks (:meth:`BlockTemplate.check`, constants compared) turns into a full capture.
    """
    def attrs(path, m):
        return tuple(sorted((k, _POSITION if (path, k) in positions else v) for k, v in _plain_attrs(m).items()))

    mods = tuple((name, type(m).__name__, attrs(name, m), m.training,
                  bool(m._forward_hooks or m._forward_pre_hooks))
                 for name, m in block.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return mods, params, buffers


def _positions(blocks: nn.ModuleList) -> frozenset:
    """(module path, attribute) of the integer attributes equal to the block's index in every block."""
    per_block = [{(path, k) for path, m in b.named_modules() for k, v in _plain_attrs(m).items()
                  if type(v) is int and v == i} for i, b in enumerate(blocks)]
    return frozenset(set.intersection(*per_block)) if per_block else frozenset()


def _uniform(blocks: nn.ModuleList) -> bool:
    positions = _positions(blocks)
    first = _signature(blocks[0], positions)
    if any(_signature(b, positions) != first for b in blocks):
        return False
    owners: dict[int, int] = {}
    for i, b in enumerate(blocks):  # no tensor shared between two blocks
        for t in list(b.parameters()) + list(b.buffers()):
            if owners.setdefault(id(t), i) != i:
                return False
    return True


@dataclass
class BlockTemplate:
    """A ModuleList of ``num_blocks`` identical blocks at ``path``, captured ``captured`` at a time."""

    path: str  # the list's module path in the user's model, e.g. "layers"
    owner: nn.Module
    attr: str
    blocks: nn.ModuleList
    captured: int = CAPTURED

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def prefix(self) -> str:
        """The list's path in the captured graph (``model.layers``)."""
        return f"{MODEL_PREFIX}.{self.path}" if self.path else MODEL_PREFIX

    @contextmanager
    def truncated(self):
        """The model with only its first ``captured`` blocks, restored afterwards."""
        setattr(self.owner, self.attr, nn.ModuleList(list(self.blocks)[: self.captured]))
        try:
            yield
        finally:
            setattr(self.owner, self.attr, self.blocks)

    # -- names ---------------------------------------------------------------------------
    def _rename(self, text: str, j: int, *, user: bool = False) -> str:
        """``text`` with the template block's index replaced by ``j`` (graph or user names)."""
        head = (self.path if user else self.prefix) + f".{self.captured - 1}"
        if text == head or text.startswith(head + "."):
            return (self.path if user else self.prefix) + f".{j}" + text[len(head):]
        return text

    def repeated_names(self, names, *, user: bool = False) -> list[str]:
        """The names of the template block in every block after it, block by block."""
        return [r for j in range(self.captured, self.num_blocks) for name in names
                if (r := self._rename(name, j, user=user)) != name]

    def extend_regions(self, plans: tuple) -> tuple:
        """Region plans (user paths) with the template block's regions repeated for every later block."""
        last = self.captured - 1
        mine = [i for i, r in enumerate(plans) if _in_block(r.columns, self.path, last)]
        if not mine:
            return plans
        template = [plans[i] for i in mine]
        extra = [type(r)(columns=tuple(self._rename(c, j, user=True) for c in r.columns),
                         rows=tuple(self._rename(c, j, user=True) for c in r.rows),
                         gathered=tuple(self._rename(c, j, user=True) for c in r.gathered))
                 for j in range(self.captured, self.num_blocks) for r in template]
        cut = mine[-1] + 1
        return tuple(plans[:cut]) + tuple(extra) + tuple(plans[cut:])

    # -- checks ----------------------------------------------------------------------------
    def check(self, gm: fx.GraphModule) -> str | None:
        """Why ``gm`` (a capture of the truncated model) cannot stand for the whole list, or None."""
        try:
            _runs(gm, self.prefix, self.captured)
        except _Irregular as exc:
            return str(exc)
        return None

    # -- the transform ---------------------------------------------------------------------
    def repeat(self, gm: fx.GraphModule, *, tp_rank: int, tp_size: int, specs: dict,
               experts: tuple[int, int, frozenset] = (1, 0, frozenset())) -> fx.GraphModule:
        """Stamp the template block out for blocks ``captured .. num_blocks - 1`` (``specs`` is extended).

        ``experts``: (ep, ep rank, the graph targets of the expert tensors split over ep,
        :mod:`autopar.passes.moe.moe_expert_parallel`): a later block's copy of one keeps this ep rank's
        experts (dim 0), then its tp shard, as the template's was cut."""
        try:
            runs = _runs(gm, self.prefix, self.captured)
        except _Irregular as exc:
            raise PassError(f"the captured blocks of {self.prefix} are no longer regular after sharding: {exc}",
                            where=f"block template {self.prefix}",
                            fix="compile with block_capture='every' (capture every block)") from exc
        template, previous = runs[-1], runs[-2]
        position = {n: i for i, n in enumerate(template)}
        corr = {p: template[i] for i, p in enumerate(previous)}  # block k-2 node -> block k-1 node
        tail_users = [(u, n) for n in template for u in n.users if u not in position]
        stamped = {self.captured - 1: template}
        counters = _module_counters(gm)
        anchor = template[-1]
        for j in range(self.captured, self.num_blocks):
            anchor, stamped[j] = self._stamp_block(gm, j, template, position, corr, stamped[j - 1], anchor,
                                                   counters, tp_rank=tp_rank, tp_size=tp_size, specs=specs,
                                                   experts=experts)
        last = stamped[self.num_blocks - 1]
        for user, node in tail_users:
            user.replace_input_with(node, last[position[node]])
        gm.graph.lint()
        gm.recompile()
        log.info("block template %s: %d blocks captured, %d repeated", self.prefix, self.captured,
                 self.num_blocks - self.captured)
        return gm

    def _stamp_block(self, gm, j, template, position, corr, before, anchor, counters, *, tp_rank, tp_size, specs,
                     experts):
        graph = gm.graph
        attrs: dict[str, fx.Node] = {}
        new_nodes: list[fx.Node] = []

        def arg_of(a: fx.Node) -> fx.Node:
            if a in position:
                return new_nodes[position[a]]
            if a in corr:
                return before[position[corr[a]]]
            if a.op == "get_attr":
                target = self._rename(a.target, j)
                if target == a.target:
                    return a
                if target not in attrs:
                    self._register(gm, a, target, tp_rank=tp_rank, tp_size=tp_size, specs=specs, experts=experts)
                    with graph.inserting_before(first):
                        attrs[target] = graph.get_attr(target)
                    attrs[target].meta = _renamed_meta(a.meta, lambda s: self._rename(s, j), target)
                return attrs[target]
            return a

        first = anchor.next
        for node in template:
            with graph.inserting_before(first):
                new = graph.node_copy(node, arg_of)
            new.meta = _renamed_meta(node.meta, lambda s: self._rename(s, j), None)
            if node.op == "call_module":
                new.target = _clone_module(gm, node.target, counters)
            new_nodes.append(new)
        return new_nodes[-1], new_nodes

    def _register(self, gm: fx.GraphModule, template_node: fx.Node, target: str, *, tp_rank, tp_size, specs,
                  experts):
        """Put block j's own tensor at ``target`` (its experts and tp shard cut like the template's)."""
        j_path = target[len(self.prefix) + 1:]
        index, _, leaf_path = j_path.partition(".")
        block = self.blocks[int(index)]
        owner_path, _, leaf = leaf_path.rpartition(".")
        owner = block.get_submodule(owner_path) if owner_path else block
        tensor = owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers[leaf]
        spec = specs.get(template_node.target)
        ep, ep_rank, split = experts
        if spec is not None or template_node.target in split:
            value = tensor.detach()
            if template_node.target in split:  # this ep rank's experts: block ep_rank of dim 0, a copy
                value = ShardLayout(0).cut(value, rank=ep_rank, size=ep)
            if spec is not None:
                specs[target] = spec
                value = spec.cut(value, rank=tp_rank, size=tp_size)
            tensor = nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                else value
        _set_attr(gm, target, tensor, persistent=leaf not in owner._non_persistent_buffers_set)


def _in_block(paths, list_path: str, index: int) -> bool:
    head = f"{list_path}.{index}"
    return bool(paths) and all(p == head or p.startswith(head + ".") for p in paths)


class _Irregular(Exception):
    """The captured graph does not show one block repeated."""


def _unit_of(node: fx.Node, prefix: str) -> int | None:
    info = get_meta(node, MODULE)
    if info is not None:
        path = info.path
    else:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
    if not path.startswith(prefix + "."):
        return None
    head = path[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _runs(gm: fx.GraphModule, prefix: str, count: int) -> list[list[fx.Node]]:
    """The call nodes of blocks 0..count-1, each a contiguous run; raises _Irregular otherwise."""
    calls = [n for n in gm.graph.nodes if n.op in _CALLS]
    units = [_unit_of(n, prefix) for n in calls]
    spans = {}
    for i, u in enumerate(units):
        if u is not None:
            lo, _ = spans.get(u, (i, i))
            spans[u] = (lo, i)
    if sorted(spans) != list(range(count)):
        raise _Irregular(f"expected blocks 0..{count - 1} of {prefix}, found {sorted(spans)}")
    runs = []
    for b in range(count):
        lo, hi = spans[b]
        if b and lo != spans[b - 1][1] + 1:
            raise _Irregular(f"code between blocks {b - 1} and {b} of {prefix}")
        runs.append(calls[lo:hi + 1])
    _check_isomorphic(runs[-2], runs[-1], runs[-3] if count > 2 else None, prefix)
    _check_readers(gm, runs)
    return runs


def _key(node: fx.Node, run: dict, prev: dict, prefix: str, index: int):
    """A node's arguments in terms that do not depend on the block index."""
    def norm(a):
        if isinstance(a, fx.Node):
            if a in run:
                return ("in", run[a])
            if a in prev:
                return ("prev", prev[a])
            if a.op == "get_attr":
                head = f"{prefix}.{index}."
                if a.target.startswith(head):
                    return ("attr", a.target[len(head):])
                if re.match(re.escape(prefix) + r"\.\d+\.", a.target):
                    raise _Irregular(f"{node.name} reads another block's weight {a.target}")
            if _unit_of(a, prefix) is not None:
                raise _Irregular(f"{node.name} reads {a.name} of an earlier block")
            return ("ext", a)
        return a
    return node.op, node.target if node.op != "call_module" else re.sub(r"_\d+$", "", node.target), \
        repr(fx.node.map_aggregate(node.args, norm)), repr(fx.node.map_aggregate(node.kwargs, norm))


def _check_isomorphic(a: list, b: list, before_a: list | None, prefix: str) -> None:
    if len(a) != len(b):
        raise _Irregular(f"blocks of {prefix} differ in size ({len(a)} and {len(b)} nodes)")
    ia, ib = {n: i for i, n in enumerate(a)}, {n: i for i, n in enumerate(b)}
    pa = {n: i for i, n in enumerate(before_a)} if before_a else {}
    index_a = _unit_of(a[0], prefix)
    for x, y in zip(a, b):
        if _key(x, ia, pa, prefix, index_a) != _key(y, ib, ia, prefix, index_a + 1):
            raise _Irregular(f"blocks {index_a} and {index_a + 1} of {prefix} differ at {x.name} / {y.name}")


def _check_readers(gm: fx.GraphModule, runs: list[list[fx.Node]]) -> None:
    """Only the next block reads a block's values; only the code after the blocks reads the last."""
    where = {n: b for b, run in enumerate(runs) for n in run}
    for b, run in enumerate(runs[:-1]):
        for n in run:
            for u in n.users:
                if where.get(u, -1) not in (b, b + 1):
                    raise _Irregular(f"{u.name} reads {n.name} of block {b}")


def _module_counters(gm: fx.GraphModule) -> dict[str, int]:
    counters: dict[str, int] = {}
    for name, _ in gm.named_children():
        base, _, index = name.rpartition("_")
        if base and index.isdigit():
            counters[base] = max(counters.get(base, 0), int(index) + 1)
    return counters


def _clone_module(gm: fx.GraphModule, target: str, counters: dict[str, int]) -> str:
    """A copy of submodule ``target`` under a fresh name (state objects such as RNG trackers shared)."""
    module = gm.get_submodule(target)
    base = re.sub(r"_\d+$", "", target)
    name = f"{base}_{counters.get(base, 0)}"
    counters[base] = counters.get(base, 0) + 1
    keep = {id(v): v for v in vars(module).values()
            if not isinstance(v, (dict, list, tuple, set, torch.Tensor, nn.Module))}
    gm.add_submodule(name, copy.deepcopy(module, memo=keep))
    return name


def _renamed_meta(meta: dict, rename, target: str | None) -> dict:
    out = dict(meta)
    info = meta.get(MODULE)
    if info is not None:
        out[MODULE] = ModuleInfo(path=rename(info.path), unit=rename(info.unit))
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {k: (rename(v[0]), *v[1:]) for k, v in stack.items()}
    param = meta.get(PARAM)
    if param is not None and target is not None:
        out[PARAM] = replace(param, name=target, aliases=tuple(rename(a) for a in param.aliases),
                             used_by_modules=tuple(rename(m) for m in param.used_by_modules))
    return out


def _set_attr(gm: nn.Module, target: str, tensor: torch.Tensor, *, persistent: bool) -> None:
    *path, leaf = target.split(".")
    owner = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=persistent)


def _candidates(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > CAPTURED and _uniform(module):
            owner_path, _, attr = name.rpartition(".")
            yield name, (model.get_submodule(owner_path) if owner_path else model), attr, module


def find_block_template(model: nn.Module, *, mode: str = "auto", plan=None) -> BlockTemplate | None:
    """The longest list of identical blocks to capture once, or None (``mode``: auto, once, every)."""
    if mode == "every":
        return None
    found = max(_candidates(model), key=lambda c: len(c[3]), default=None)
    if found is None:
        return None
    name, owner, attr, blocks = found
    if mode == "auto" and (len(blocks) < MIN_BLOCKS or not any(p.is_meta for p in model.parameters())):
        return None
    if plan is not None and not _plan_uniform(plan, name, len(blocks)):
        log.info("block template: the plan's tensor-parallel regions differ between blocks; capturing all")
        return None
    return BlockTemplate(path=name, owner=owner, attr=attr, blocks=blocks)


def _plan_uniform(plan, path: str, num_blocks: int) -> bool:
    """Do the plan's tp regions look the same in every block of ``path``?"""
    per_block: dict[int, set] = {i: set() for i in range(num_blocks)}
    pattern = re.compile(re.escape(path) + r"\.(\d+)(\.|$)")
    for region in plan.tp_regions:
        found = pattern.match(region.columns[0]) if region.columns else None
        if found:
            index = int(found.group(1))
            norm = lambda p: pattern.sub(f"{path}.#\\2", p, count=1)  # noqa: E731
            per_block[index].add((tuple(map(norm, region.columns)), tuple(map(norm, region.rows))))
    return len({frozenset(v) for v in per_block.values()}) <= 1


def repeat_blocks(st: LoweringState) -> LoweringState:
    """The lowering's pass: the template block stamped out for every block not captured, with the later
    blocks' shards (``specs``), expert tensors, partial-gradient parameters and region plans."""
    t, specs = st.template, dict(st.specs)  # (repeat adds the later blocks' shards)
    gm = t.repeat(st.gm, tp_rank=st.tp_rank, tp_size=st.plan.mesh.tp, specs=specs,
                  experts=(st.plan.dims.ep, st.ep_rank, frozenset(st.experts)))
    return replace(st, gm=gm, specs=specs, experts=st.experts + tuple(t.repeated_names(st.experts)),
                   partial_grads=st.partial_grads + tuple(t.repeated_names(st.partial_grads)),
                   region_plans=t.extend_regions(st.region_plans))


def capture_blocks(template: BlockTemplate | None, capture_fn):
    """``capture_fn()`` of the truncated model when its graph shows the blocks repeat, else of the whole model.

    Returns (the CapturedGraph, the template or None).
    """
    if template is None:
        return capture_fn(), None
    with template.truncated():
        captured = capture_fn()
    reason = template.check(captured.gm)
    if reason is None:
        return captured, template
    log.info("block template %s not used (%s): capturing every block", template.prefix, reason)
    return capture_fn(), None
