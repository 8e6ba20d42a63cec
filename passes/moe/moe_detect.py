"""Analysis: find the mixture-of-experts layers of a captured graph, whatever module wrote them.

A layer is recognised from its dataflow, not from class names:

- **router**: a ``linear`` whose weight is an [E, H] parameter, then ``softmax`` or ``sigmoid``
  (dtype casts allowed between), then ``topk(k)``;
- **experts**, one of three forms read off the ops that consume the top-k ids:
  ``grouped``: rows sorted by expert and a grouped matmul with cumulative offsets over a 3-D
  [E, ., .] parameter (``torch._grouped_mm``, ``F.grouped_mm``, transformers' ``grouped_mm``
  experts); ``gathered``: a 3-D [E, ., .] parameter indexed by each row's expert id, then a batched
  matmul (transformers' ``batched_mm`` experts, plain-torch fused experts); ``loop``: a ModuleList
  of E experts each run on every token and weighted by a gate that is zero off the top-k;
- **combine**: the node that sums the weighted expert outputs back to one row per token;
- **shared experts** (DeepSeek): parameterised branches from the layer's input added to the combine;
- **auxiliary load-balancing loss**: the nodes that read the router's logits or scores but do not
  feed the routed computation (they reach the loss another way).

Every node of a layer gets an :class:`MoeRole` (``autopar.moe``); the router's linear gets the
layer's :class:`MoeLayer` summary (``autopar.moe_layer``). ``find_moe_layers`` also says which
``topk`` nodes were not recognised as a router and why.

Example::

    >>> import torch
    >>> from autopar.models.moe import build_moe, moe_loss
    >>> from autopar.passes.frontend.capture import capture
    >>> model = build_moe("switch")
    >>> idx = torch.randint(0, 64, (2, 8))
    >>> gm = capture(model, (idx,), loss_fn=moe_loss, example_target=idx).gm
    >>> report = find_moe_layers(gm)
    >>> [(l.path, l.form, l.num_experts, l.top_k, l.scoring) for l in report.layers][:1]
    [('model.blocks.0.moe', 'gathered', 4, 1, 'softmax')]
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir.meta_keys import MOE, MOE_LAYER, MoeLayer, MoeRole, set_meta
from autopar.passes.frontend.annotate import module_path_of

__all__ = ["MoeReport", "find_moe_layers", "annotate_moe", "grouped_mm_ops", "strip", "descendants", "ancestors",
           "op_name", "value_shape"]

_PASS_THROUGH = ("to.dtype", "to.dtype_layout", "alias.default", "contiguous.default", "clone.default",
                 "_to_copy.default", "transpose.int", "t.default", "permute.default")
_SCORES = {"softmax.int": "softmax", "_softmax.default": "softmax", "sigmoid.default": "sigmoid"}
_BATCHED = ("bmm.default", "matmul.default", "einsum.default")


@dataclass(frozen=True)
class MoeReport:
    """What :func:`find_moe_layers` found: the layers, and (where, why) of every top-k left out."""

    layers: tuple[MoeLayer, ...]
    unrecognised: tuple[tuple[str, str], ...]


def op_name(node: fx.Node) -> str:
    """``aten.softmax.int`` -> ``softmax.int``; the op name of a call_function node ('' otherwise)."""
    if node.op != "call_function":
        return ""
    name = str(node.target)
    return name.split(".", 1)[1] if name.startswith("aten.") else name


def grouped_mm_ops() -> tuple:
    """The grouped-matmul ops with offsets: torch's own, and transformers' fallback when it is loaded."""
    ops = [torch.ops.aten._grouped_mm.default]
    if hasattr(torch.ops, "transformers") and hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        ops.append(torch.ops.transformers.grouped_mm_fallback.default)
    return tuple(ops)


def strip(node, ops=_PASS_THROUGH):
    """Follow ``node`` up through casts, aliases and transposes to the value they pass on."""
    while isinstance(node, fx.Node) and op_name(node) in ops:
        node = node.args[0]
    return node


def _param(gm: fx.GraphModule, node) -> torch.Tensor | None:
    node = strip(node)
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.nn.Parameter) else None


def _reach(start: list[fx.Node], step) -> set[fx.Node]:
    seen, todo = set(), list(start)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(step(node))
    return seen


def descendants(start: list[fx.Node]) -> set[fx.Node]:
    """``start`` and every node that reads them, directly or not."""
    return _reach(start, lambda n: n.users)


def ancestors(start: list[fx.Node]) -> set[fx.Node]:
    """``start`` and every node they read, directly or not."""
    return _reach(start, lambda n: n.all_input_nodes)


def value_shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _getitem(node: fx.Node, index: int) -> fx.Node | None:
    import operator
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def _router(gm, topk: fx.Node):
    """(linear node, scores node, scoring) of the router feeding ``topk``, or (None, None, why)."""
    scores = strip(topk.args[0])
    scoring = _SCORES.get(op_name(scores)) if isinstance(scores, fx.Node) else None
    if scoring is None:
        what = op_name(scores) if isinstance(scores, fx.Node) else type(scores).__name__
        return None, None, f"top-k over {what or scores.op}, not over a router's softmax or sigmoid"
    linear = strip(scores.args[0])
    weight = _param(gm, linear.args[1]) if isinstance(linear, fx.Node) and op_name(linear) == "linear.default" else None
    if weight is None or weight.dim() != 2:
        return None, None, f"the {scoring} scores do not come from a linear layer with a 2-D weight"
    return linear, scores, scoring


def _owners(gm: fx.GraphModule) -> dict[fx.Node, fx.Node | None]:
    """{node: the top-k its value is routed by}: the latest top-k among its ancestors (one pass, graph order)."""
    order, owner = {}, {}
    for i, node in enumerate(gm.graph.nodes):
        order[node] = i
        if op_name(node) == "topk.default":
            owner[node] = node
            continue
        found = [owner[a] for a in node.all_input_nodes if owner.get(a) is not None]
        owner[node] = max(found, key=order.get) if found else None
    return owner


def _expert_ops(gm, ids: fx.Node, num_experts: int, owners: dict):
    """(form, expert op nodes, 3-D expert weight get_attrs, row-id node, offsets node) reading ``ids``."""
    topk = ids.args[0]
    reach = {n for n in descendants([ids]) if owners.get(n) is topk}
    grouped = set(grouped_mm_ops())
    ops, weights, row_ids, offsets = [], [], None, None
    for node in gm.graph.nodes:
        if node not in reach or node.op != "call_function":
            continue
        if node.target in grouped:
            offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
            weight = _param(gm, node.args[1])
            if offs in reach and weight is not None and weight.dim() == 3 and weight.shape[0] == num_experts:
                ops.append(node)
                weights.append(strip(node.args[1]))
                offsets = offs
        elif op_name(node) == "index.Tensor":
            weight = _param(gm, node.args[0])
            if weight is not None and weight.dim() == 3 and weight.shape[0] == num_experts:
                ops.extend(u for u in node.users if op_name(u) in _BATCHED)
                weights.append(strip(node.args[0]))
                row_ids = node.args[1][0]
    if offsets is not None:  # the rows' expert ids: what the offsets count (histc/bincount of the sorted ids)
        counts = strip(offsets, _PASS_THROUGH + ("cumsum.default",))
        row_ids = strip(counts.args[0]) if isinstance(counts, fx.Node) and counts.args else None
        return "grouped", ops, weights, row_ids, offsets
    return ("gathered", ops, weights, row_ids, None) if ops else (None, [], [], None, None)


def _loop_experts(gm, layer: str, router: fx.Node, num_experts: int):
    """(linear nodes, their weight get_attrs) of a ModuleList of ``num_experts`` experts under ``layer``."""
    pattern = re.compile(re.escape(layer) + r"\.(\w+)\.(\d+)(\.|$)")
    found: dict[tuple[str, str], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node is router or op_name(node) != "linear.default" or _param(gm, node.args[1]) is None:
            continue
        match = pattern.match(module_path_of(node))
        if match:
            found.setdefault((match.group(1), match.group(2)), []).append(node)
    lists: dict[str, list] = {}
    for (name, _), nodes in found.items():
        lists.setdefault(name, []).append(nodes)
    for name, experts in lists.items():
        if len(experts) == num_experts:
            ops = [n for nodes in experts for n in nodes]
            return ops, [strip(n.args[1]) for n in ops]
    return [], []


def _combine(ops: list[fx.Node], weights_node: fx.Node, token_shape) -> fx.Node | None:
    """The node that sums the gate-weighted expert outputs into one row per token."""
    out, gated = descendants(ops), descendants([weights_node])
    both = [n for n in ops[0].graph.nodes if n in out and n in gated and value_shape(n) == token_shape]
    if not both:
        return None
    node = both[0]
    while True:  # a loop over experts accumulates: follow the adds that bring in another expert's output
        nxt = [u for u in node.users if op_name(u) == "add.Tensor" and u in gated and value_shape(u) == token_shape
               and all(a in out for a in u.all_input_nodes)]
        if len(nxt) != 1:
            return node
        node = nxt[0]


def _shared(gm, combine: fx.Node, x: fx.Node, gated: set) -> list[fx.Node]:
    """Linear nodes of branches from the layer input ``x`` that are added to the combine (shared experts)."""
    from_x = descendants([x])
    found = []
    for user in combine.users:
        if op_name(user) not in ("add.Tensor", "add_.Tensor"):
            continue
        for other in user.all_input_nodes:
            if other is combine or other in gated or other not in from_x:
                continue
            branch = ancestors([other]) & from_x
            found += [n for n in branch if op_name(n) == "linear.default" and _param(gm, n.args[1]) is not None]
    return sorted(found, key=lambda n: n.name)


def _layer_path(router: fx.Node, weights: list[fx.Node]) -> str:
    paths = [module_path_of(router)] + [module_path_of(next(iter(w.users))) for w in weights if w.users]
    parts = [p.split(".") for p in paths]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    prefix = ".".join(common)
    return prefix if len(paths) > 1 and prefix != paths[0] else module_path_of(router).rpartition(".")[0]


def _one_layer(gm, topk: fx.Node, output_ancestors: set, owners: dict):
    """A :class:`MoeLayer` for the router ending at ``topk`` plus {node: role}, or (None, why)."""
    linear, scores, scoring = _router(gm, topk)
    if linear is None:
        return None, scoring
    num_experts, k = _param(gm, linear.args[1]).shape[0], int(topk.args[1])
    vals, ids = _getitem(topk, 0), _getitem(topk, 1)
    if ids is None or vals is None:
        return None, "the router's top-k ids or weights are never read"
    form, ops, weights, row_ids, offsets = _expert_ops(gm, ids, num_experts, owners)
    if form is None:
        layer = module_path_of(linear).rpartition(".")[0]
        ops, weights = _loop_experts(gm, layer, linear, num_experts)
        form = "loop" if ops else None
    if form is None:
        return None, (f"a router of {num_experts} experts, but no expert computation reads its top-k: expected "
                      "a grouped matmul with offsets, a 3-D expert tensor indexed by expert id, or a ModuleList "
                      f"of {num_experts} experts")
    x = linear.args[0]
    combine = _combine(ops, vals, value_shape(x))
    if combine is None:
        return None, "the expert outputs are never weighted by the router and summed per token"
    shared = _shared(gm, combine, x, descendants([vals]))
    routed = ancestors([combine])
    after = descendants([combine])
    aux = [n for n in descendants([linear]) if n not in routed and n not in after and n in output_ancestors]
    path = _layer_path(linear, weights)
    roles = {linear: "router", scores: "scores", topk: "topk", combine: "combine"}
    roles.update({n: "expert_op" for n in ops})
    roles.update({w: "expert_weight" for w in weights})
    roles.update({n: "shared_expert" for n in shared})
    roles.update({n: "aux_loss" for n in aux if n not in roles})
    if row_ids is not None:
        roles.setdefault(row_ids, "row_ids")
    if offsets is not None:
        roles.setdefault(offsets, "offsets")
    layer = MoeLayer(path=path, form=form, num_experts=num_experts, top_k=k, scoring=scoring,
                     router=linear.name, router_weight=strip(linear.args[1]).target, topk=topk.name,
                     expert_weights=tuple(dict.fromkeys(w.target for w in weights)),
                     expert_ops=tuple(n.name for n in ops), row_ids=row_ids.name if row_ids is not None else None,
                     offsets=offsets.name if offsets is not None else None, combine=combine.name,
                     shared_experts=tuple(dict.fromkeys(module_path_of(n) for n in shared)),
                     aux_loss=tuple(n.name for n in sorted(aux, key=lambda n: n.name)))
    return (layer, roles), None


def _find(gm: fx.GraphModule):
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output_ancestors = ancestors([output])
    owners = _owners(gm)
    layers, unrecognised = [], []
    for node in gm.graph.nodes:
        if op_name(node) != "topk.default":
            continue
        found, why = _one_layer(gm, node, output_ancestors, owners)
        if found is None:
            unrecognised.append((node, f"node {node.name} ({module_path_of(node) or 'the root'})", why))
        else:
            layers.append(found)
    in_aux = {n for _, roles in layers for n, role in roles.items() if role == "aux_loss"}
    unrecognised = [(where, why) for node, where, why in unrecognised if node not in in_aux]
    return MoeReport(layers=tuple(l for l, _ in layers), unrecognised=tuple(unrecognised)), layers


def find_moe_layers(gm: fx.GraphModule) -> MoeReport:
    """Every MoE layer of ``gm`` (in graph order), and the top-k nodes that are not a router, with why."""
    return _find(gm)[0]


def annotate_moe(gm: fx.GraphModule) -> MoeReport:
    """Write ``autopar.moe`` on every node of a recognised layer and ``autopar.moe_layer`` on its router."""
    report, layers = _find(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for layer, roles in layers:
        for node, role in roles.items():
            set_meta(node, MOE, MoeRole(layer=layer.path, role=role))
        set_meta(by_name[layer.router], MOE_LAYER, layer)
    return report
