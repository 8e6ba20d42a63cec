"""Column-parallel with a gathered output: Megatron's ``ColumnParallelLinear(gather_output=True)``.

A projection whose column region cannot close with a row-parallel linear is still column-sharded:
its weight (and bias) hold this rank's output features, its input enters through an f
(:class:`~autopar.ops.collectives.TpCopy`: the input's gradient is partial on each rank), and its
output is all-gathered on the feature dim (:class:`~autopar.ops.collectives.TpGather`, a visible
graph node; backward keeps this rank's slice of the gradient, no communication: what reads the
gathered output runs replicated, so every rank computes the same gradient of it).

A region cannot close when the projection's output, followed through every op whose placement rule
(:data:`autopar.passes.tp.tp_rules.RULES`) takes it, meets only ops that need it whole (an op with no
rule: a norm, a convolution, the loss; the graph output; a residual add of a replicated value) and
never another projection: BERT's and RoBERTa's MLM-head dense before its norm, Swin's patch-merging
``reduction`` before the next stage's norm. A projection that reaches another one, or whose output a
rule refuses (a router's softmax over its scores), keeps its reason to stay replicated, and so do
logits the loss or the graph output read (a head the vocabulary pass leaves, or is told to leave, whole).

A convolution (``groups`` 1, not transposed) is sharded the same way on its output channels (weight
dim 0, bias dim 0), its output gathered on the channel dim 1: the patch embeddings of ViT, CLIP and
Swin. The region finder (:func:`autopar.passes.tp.tp_regions.find_tp_regions`) asks for such a region
only when a candidate's own region is dropped, so every region that closes (Megatron's 2 forward and
2 backward all-reduces per block) is unchanged.

Example::

    >>> import torch, torch.nn as nn
    >>> from autopar.passes.frontend.capture import capture
    >>> from autopar.passes.frontend.annotate import annotate
    >>> from autopar.passes.tp.tensor_parallel import shard_tensor_parallel
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.passes.tp.tp_select import select_tp_regions
    >>> from autopar.plan_model import MeshShape
    >>> class Head(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.dense, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
    ...     def forward(self, x):
    ...         return self.norm(torch.relu(self.dense(x)))
    >>> x = torch.randn(2, 8)
    >>> gm = annotate(capture(Head(), (x,)).gm, example_inputs=(x,))
    >>> st = shard_tensor_parallel(select_tp_regions(LoweringState.of_graph(gm, mesh=MeshShape(tp=2))))
    >>> st.specs["model.dense.weight"], [n.target for n in st.gm.graph.nodes if n.op == "call_module"]
    (ShardLayout(dim=0), ['tp_copy_0', 'tp_gather_output_0'])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.ir.meta_keys import MODULE, PARAM, TP_PLACEMENT, Placement, get_meta, set_meta
from autopar.ops.collectives import TpGather
from autopar.passes.tp.tp_projection import projection_of
from autopar.passes.tp.tp_rules import REPLICATE, RULES, NoRule, op_name, rule_for, shape_of

__all__ = ["Conv", "conv_of", "column_input", "closes_nowhere", "gathered_placements", "insert_output_gathers"]

_CONVS = ("conv1d", "conv2d", "conv3d", "convolution")
_LOSSES = ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "mse_loss", "binary_cross_entropy_with_logits")


@dataclass(frozen=True)
class Conv:
    """``conv(x, W, b)`` with ``W`` (and ``b``) parameters read only here, ``groups`` 1, not transposed."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None


def _param_read(node) -> bool:
    info = get_meta(node, PARAM) if isinstance(node, fx.Node) and node.op == "get_attr" else None
    return info is not None and info.is_parameter and len(node.users) == 1 and len(info.aliases) == 1


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def conv_of(node: fx.Node) -> Conv | None:
    """The convolution ``node`` computes (see :class:`Conv`), or None."""
    if node.op != "call_function" or op_name(node) not in _CONVS or not isinstance(node.args[0], fx.Node):
        return None
    weight, bias = node.args[1], _arg(node, 2, "bias", None)
    if op_name(node) == "convolution":
        transposed, groups = _arg(node, 6, "transposed", False), _arg(node, 8, "groups", 1)
    else:
        transposed, groups = False, _arg(node, 6, "groups", 1)
    if transposed or groups != 1 or not _param_read(weight) or (bias is not None and not _param_read(bias)):
        return None
    return Conv(node, node.args[0], weight, bias)


def column_input(column: fx.Node) -> fx.Node:
    """The input a column (a projection or a convolution) reads replicated: where its f goes."""
    proj = projection_of(column)
    return proj.x if proj is not None else conv_of(column).x


def _reaches_projection(node: fx.Node) -> bool:
    """Whether ``node``'s output, followed through ops that have a placement rule, reaches a projection."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if projection_of(user) is not None:
                return True
            if op_name(user) in RULES:
                stack.append(user)
    return False


def _refused(node: fx.Node, placement: Placement) -> bool:
    """Whether a rule refuses ``node``'s shard where it is followed (a softmax over it: a router's scores),
    or the shard reaches the loss or the graph output (logits: the vocabulary pass's to shard, or not).

    Followed through every op whose rule takes it, up to the ops that need it whole: one with no rule,
    one that would need another operand sharded too (a residual add).
    """
    placed, stack = {node: placement}, [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user.op == "call_function" and op_name(user) in _LOSSES:
                return True
            if user in placed or user.op != "call_function" or op_name(user) not in RULES:
                continue
            try:
                out, need = rule_for(user)(user, placed)
            except NoRule:
                return True
            if all(p == REPLICATE or n in placed for n, p in need.items()):
                placed[user] = out
                stack.append(user)
    return False


def closes_nowhere(node: fx.Node, placement: Placement) -> bool:
    """Whether a column at ``node`` placed ``placement`` can close only by gathering its output.

    True when its output never reaches another projection through ops with a rule (no row could
    close it), no rule refuses the shard on the way to the ops that need it whole, and it is not
    the logits (read by the loss or the graph output as they are).
    """
    return not _reaches_projection(node) and not _refused(node, placement)


def gathered_placements(node: fx.Node, *, tp_size: int | None) -> dict[fx.Node, Placement] | None:
    """{node: placement} of a column with a gathered output at ``node``, or None where it cannot be one.

    A projection qualifies when its region cannot close (:func:`closes_nowhere`), a convolution
    always; either needs its output features (channels) divisible by ``tp_size``.
    """
    proj, conv = projection_of(node), conv_of(node)
    if proj is None and conv is None:
        return None
    dim = len(shape_of(node)) - 1 if proj is not None else 1
    out = Placement.shard(dim)
    if tp_size is None or shape_of(node)[dim] % tp_size or proj is not None and not closes_nowhere(node, out):
        return None
    if proj is not None:
        placed = {node: out, proj.weight: Placement.shard(proj.out_dim)}
        if proj.via is not None:
            placed[proj.via] = Placement.shard(1 - proj.out_dim)
    else:
        placed = {node: out, conv.weight: Placement.shard(0)}
    bias = proj.bias if proj is not None else conv.bias
    if bias is not None:
        placed[bias] = Placement.shard(0)
    return placed


def insert_output_gathers(gm: fx.GraphModule, gathers, *, tp_size: int) -> None:
    """A :class:`TpGather` on each node of ``gathers``, on the dim its placement shards; its readers read that."""
    for node in gathers:
        p = get_meta(node, TP_PLACEMENT)
        i = 0
        while hasattr(gm, f"tp_gather_output_{i}"):
            i += 1
        name = f"tp_gather_output_{i}"
        gm.add_submodule(name, TpGather(axis="tp", size=tp_size, dim=p.dim))
        users = list(node.users)
        with gm.graph.inserting_after(node):
            gathered = gm.graph.call_module(name, (node,))
        gathered.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", MODULE)})
        set_meta(gathered, TP_PLACEMENT, Placement("R"))
        for user in users:
            user.replace_input_with(node, gathered)
