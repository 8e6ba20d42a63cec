"""A ``loss_fn`` that is a mean over the target's tokens: found, so each microbatch's loss is weighted by its tokens.

``F.cross_entropy(logits, target)`` (and ``nll_loss``) average over the target entries that are
not ``ignore_index``. A step of several microbatches and dp replicas averages those means, which
equals one device's loss over the whole batch only when every microbatch holds as many counted
entries. Padded targets (-100) break that: a microbatch of mostly padding weighs its few tokens
as much as a full one's many.

:func:`token_mean_loss` recognises such a loss where the graph's loss *is* the op (its output,
nothing after it), its class weights are None and its target comes from the ``target`` input
through layout ops only (reshape, view, contiguous: no slice, so each target entry is one counted
entry). The graph is left as it is (it computes the call's mean); the runtime weighs each
microbatch's loss by ``n_i · m · dp / N`` (``n_i`` its counted entries, ``N`` the step's over every
microbatch and dp rank: :func:`autopar.runtime.execution.item_count.add_loss_weights`), so the step's loss and
gradients weigh every token ``1 / N``, as one device does. Any other loss is averaged per
microbatch, as written.

    >>> import torch
    >>> from autopar.passes.frontend.capture import capture
    >>> gm = capture(torch.nn.Linear(4, 3), (torch.randn(2, 4),), loss_fn=torch.nn.functional.cross_entropy,
    ...              example_target=torch.tensor([0, 2])).gm
    >>> token_mean_loss(gm)
    ItemCount(labels='target', shift=0, ignore_index=-100, input='autopar_loss_weight')
    >>> token_mean_loss(capture(torch.nn.Linear(4, 3), (torch.randn(2, 4),), loss_fn=torch.nn.functional.mse_loss,
    ...                              example_target=torch.randn(2, 3)).gm) is None
    True
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.ir.captured_graph import LOSS_WEIGHT, ItemCount
from autopar.passes.lowering_state import LoweringState

__all__ = ["token_mean_loss", "find_token_mean_loss"]

aten = torch.ops.aten
MEAN = 1  # torch's reduction enum
_TOKEN_MEAN_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
# ops that move the target's entries without dropping or repeating any
_LAYOUT_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                         aten.contiguous.default, aten.alias.default, aten._to_copy.default, aten.flatten.using_ints})


def _bound(node: fx.Node) -> dict:
    """The op's arguments by name, defaults filled in."""
    values = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        else:
            values[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return values


def _from_target(node, target: fx.Node) -> bool:
    while isinstance(node, fx.Node) and node is not target:
        if node.op != "call_function" or node.target not in _LAYOUT_OPS:
            return False
        node = node.args[0]
    return node is target


def find_token_mean_loss(st: LoweringState) -> LoweringState:
    """An analysis pass: the captured graph's loss weight when its loss is a token mean of the ``loss_fn``'s
    target (``CapturedGraph.loss_weight``, read by the runtime; the graph is left as it is)."""
    if not st.captured.has_target:
        return st
    return dataclasses.replace(st, captured=dataclasses.replace(st.captured, loss_weight=token_mean_loss(st.gm)))


def token_mean_loss(gm: fx.GraphModule, target_name: str = "target") -> ItemCount | None:
    """How to count the tokens of ``gm``'s loss when it is a token mean of its target (else None)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [a for a in torch.utils._pytree.tree_flatten(output.args[0])[0] if isinstance(a, fx.Node)]
    target = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == target_name), None)
    if len(leaves) != 1 or target is None:
        return None
    loss = leaves[0]
    if loss.op != "call_function" or loss.target not in _TOKEN_MEAN_LOSSES:
        return None
    args = _bound(loss)
    if args["reduction"] != MEAN or args["weight"] is not None or not _from_target(args["target"], target):
        return None
    return ItemCount(labels=target_name, shift=0, ignore_index=int(args["ignore_index"]), input=LOSS_WEIGHT)
