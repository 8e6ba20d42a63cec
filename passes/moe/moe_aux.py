"""Transform: the router's load-balancing loss over the global batch, as one device computes it.

A load-balancing loss multiplies two batch statistics (Switch: ``E * sum_e f_e * P_e``, the share of
rows routed to expert ``e`` and its mean router probability), so the mean over dp of per-rank losses is
not the loss of the whole batch. Megatron-LM's ``global_aux_loss`` answers by all-reducing the
statistics; here every reduction over the token (or row) dim inside a recognised layer's auxiliary
loss (``mean``/``sum`` over dim 0, ``histc`` of the routed ids, a ``scatter_add`` of per-row weights into
expert bins, as Mixtral's loss counts unpadded tokens per expert) is followed by a
:class:`~autopar.ops.moe_ops.DpMean` node, and so is a token count the loss divides by that reads no weight
(Mixtral's ``attention_mask.sum()`` of unpadded rows: it reads no router, so it is not in the loss's own nodes): its value becomes the dp mean, equal to one device's
statistic (every rank holds as many rows). The node's backward is the identity: each rank's gradient
into its own share is then the whole loss's, and DDP's mean over dp makes it one device's gradient.

Exact when each rank runs its batch in one microbatch (``num_microbatches=1``); with more, each
microbatch computes its own statistics, as on one device running that microbatch.

Example::

    >>> import torch
    >>> from autopar.models.moe import build_moe, moe_loss
    >>> from autopar.passes.frontend.capture import capture
    >>> idx = torch.randint(0, 64, (2, 8))
    >>> gm = capture(build_moe("switch"), (idx,), loss_fn=moe_loss, example_target=idx).gm
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.plan_model import MeshShape
    >>> st = sync_router_statistics(LoweringState.of_graph(gm, mesh=MeshShape(dp=2)))
    >>> sum(isinstance(m, DpMean) for m in st.gm.modules())   # f and P of each of the two layers
    4
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopar.ir.meta_keys import MODULE
from autopar.ops.moe_ops import DpMean
from autopar.passes.lowering_state import LoweringState
from autopar.passes.moe.moe_detect import annotate_moe, descendants, op_name, strip, value_shape

__all__ = ["sync_router_statistics"]

_REDUCTIONS = ("mean.dim", "sum.dim_IntList", "mean.default", "sum.default", "histc.default", "scatter_add.default",
               "scatter_add_.default")


def _reduces_rows(node: fx.Node, rows: set[int]) -> bool:
    """A reduction over dim 0 of a tensor whose dim 0 is the token or row count (a scatter_add: its rows' index)."""
    if op_name(node).startswith("scatter_add"):
        index = value_shape(node.args[2])
        return node.args[1] == 0 and bool(index) and index[0] in rows
    source = node.args[0]
    shape = value_shape(source)
    if not shape or shape[0] not in rows:
        return False
    if op_name(node) in ("mean.default", "sum.default", "histc.default"):
        return True
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return any(d % len(shape) == 0 for d in dims)


def sync_router_statistics(st: LoweringState) -> LoweringState:
    """Average every token-dim statistic of the MoE layers' auxiliary losses over dp (the state as it was
    when the graph has none)."""
    return dataclasses.replace(st, gm=st.gm) if _average_statistics(st.gm, dp=st.plan.mesh.dp) else st


def _weightless_counts(gm: fx.GraphModule, aux: set[str], rows: set[int]) -> set[str]:
    """Names of the reductions over rows that read no weight (nor router) and reach the auxiliary loss's nodes
    ``aux`` through nodes that read no weight either: the token counts it divides by (a padding mask's sum).
    A label count the main loss divides by is not one: it meets the weights (the loss's logits) first."""
    weighted = descendants([n for n in gm.graph.nodes if n.op == "get_attr"])
    found = set()
    for node in gm.graph.nodes:
        if node.name in aux or node in weighted or op_name(node) not in _REDUCTIONS or not _reduces_rows(node, rows):
            continue
        frontier, seen = list(node.users), set()
        while frontier:
            user = frontier.pop()
            if user in seen:
                continue
            seen.add(user)
            if user.name in aux:
                found.add(node.name)
                break
            if user not in weighted:
                frontier.extend(user.users)
    return found


def _average_statistics(gm: fx.GraphModule, *, dp: int) -> int:
    """Put a DpMean after every token-dim statistic of the auxiliary losses; how many."""
    report = annotate_moe(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {name: i for i, name in enumerate(nodes)}
    count, synced = 0, set()
    for layer in report.layers:
        tokens = value_shape(strip(nodes[layer.router].args[0]))
        if not tokens:
            continue
        rows = {tokens[0], tokens[0] * layer.top_k}
        counts = _weightless_counts(gm, set(layer.aux_loss), rows)
        for name in sorted(set(layer.aux_loss) | counts, key=order.get):
            node = nodes[name]
            if op_name(node) not in _REDUCTIONS or not _reduces_rows(node, rows) or node in synced:
                continue
            module = f"moe_dp_mean_{count}"
            gm.add_submodule(module, DpMean(axis="dp", size=dp))
            with gm.graph.inserting_after(node):
                mean = gm.graph.call_module(module, (node,))
            mean.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", MODULE)})
            node.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
            synced |= descendants([mean])
            count += 1
    gm.recompile()
    return count
