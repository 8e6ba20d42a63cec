"""Vocabulary parallelism: the token embedding and the LM head sharded on the vocabulary dim.

Tensor-parallel rank ``r`` of ``tp`` holds rows ``[r·V/tp, (r+1)·V/tp)`` of each vocabulary
matrix (``ShardLayout(dim=0)``):

- **Embedding:** a masked lookup of the local rows (token ids outside the range read row 0 and
  are zeroed), then :class:`TpReduce` sums the ranks' partial embeddings (a visible all-reduce).
- **LM head:** column-parallel on the vocabulary: :class:`TpCopy` before it, its weight's local
  rows, its logits sharded on the last dim and never gathered when a loss follows:
  ``cross_entropy_loss`` becomes one :class:`VocabParallelCrossEntropy` node.
- **No loss (inference):** the logits are gathered (:class:`TpGather` on the vocabulary dim)
  right before the graph output, so the program returns what the model returns.
- **Tied weights** (GPT: one parameter read by the embedding and the head) get one spec, dim 0,
  for both uses; on two pipeline stages both copies hold the same rows, and the runtime's
  shared-gradient sum adds the shards element-wise.
- **padding_idx** (BERT, OPT, RoBERTa): the rank holding the padding row looks it up as its local
  padding row, so that row's gradient stays zero, as on one device.
- **Position tables** (learned positions: indices from ``arange`` or computed from the inputs, as
  RoBERTa's ``cumsum`` over the padding mask) stay replicated, as Megatron-LM keeps them: a token
  embedding is one whose indices are a graph input passed through shape-only ops.
- **Encoder MLM heads** (BERT, RoBERTa: dense, norm, then a decoder tied to the word embeddings):
  the decoder is the vocabulary head, its bias sharded with it; the dense before the norm is a column
  with a gathered output (passes/tp/tp_gather_output.py: its output feeds a norm over the hidden dim).
- **Buffers on the logits** (BART's ``final_logits_bias``): a value without a gradient the head's chain
  needs sharded is cut by each rank to its vocabulary slice (``local_shard``), no communication.

A head is recognised when its output reaches ``aten.cross_entropy_loss`` (mean or sum reduction, no
class weights, no label smoothing, 2-D logits) or, without a loss, the graph output with as many
classes as a token embedding has rows. Anything else stays replicated with a warning naming why;
an embedding tied to a replicated head stays replicated too. A vocabulary that does not divide
by tp stays replicated with a warning, or raises :class:`ShardingError` when the user asked for
``vocab_parallel=True``.

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> from autopar.passes.frontend.annotate import annotate
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.plan_model import MeshShape
    >>> st = LoweringState.of_graph(gm, mesh=MeshShape(tp=2), tp_rank=0)
    >>> st = shard_vocab_parallel(dataclasses.replace(st, vocab=find_vocab_parallel(gm)))
    >>> st.specs["model.lm_head.weight"]
    ShardLayout(dim=0)
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.errors import ShardingError
from autopar.ir.meta_keys import MODULE, PARAM, TENSOR, TP_PLACEMENT, Placement, get_meta, set_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.ops.collectives import TpCopy, TpGather, TpReduce
from autopar.ops.tp_ops import VocabParallelCrossEntropy
from autopar.passes.lowering_state import LoweringState
from autopar.passes.tp.tensor_parallel import insert_local_slices, localize_sizes, node_where, set_param
from autopar.passes.tp.tp_regions import grad_carriers
from autopar.passes.tp.tp_rules import REPLICATE, NoRule, op_name, rule_for, shape_of

__all__ = ["VocabParallel", "find_vocab_parallel", "shard_vocab_parallel", "module_path"]

log = logging.getLogger(__name__)
aten = torch.ops.aten
_MEAN = 1  # at::Reduction::Mean
_REDUCTIONS = {1: "mean", 2: "sum"}  # at::Reduction: a sum is what a loss dividing by num_items_in_batch takes


@dataclass
class VocabParallel:
    """What the vocabulary pass shards: token embeddings, the head, and the head's path to its ends."""

    embeddings: list[fx.Node] = field(default_factory=list)
    head: fx.Node | None = None
    chain: dict[fx.Node, Placement] = field(default_factory=dict)  # head .. last op before the ends
    losses: list[fx.Node] = field(default_factory=list)  # cross_entropy_loss nodes
    outputs: list[fx.Node] = field(default_factory=list)  # chain nodes the graph output reads
    # values without a gradient the chain reads sharded (BART's final_logits_bias): each rank its slice
    local_slices: dict[fx.Node, Placement] = field(default_factory=dict)

    def paths(self) -> tuple[str, ...]:
        """Module paths of the sharded embeddings and head (what the Plan records)."""
        return tuple(module_path(n) for n in self.embeddings + ([self.head] if self.head else []))

    def __bool__(self) -> bool:
        return bool(self.embeddings or self.head)


def module_path(node: fx.Node) -> str:
    info = get_meta(node, MODULE)
    return info.path if info and info.path else node.name


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_param(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "get_attr" and get_meta(node, PARAM) is not None
            and get_meta(node, PARAM).is_parameter)


def _reads_input(node: fx.Node) -> bool:
    """Does ``node`` depend on a graph input (token ids), rather than on constants (positions)?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


# ops that carry token ids unchanged (a graph input reaches a token embedding only through these)
_ID_OPS = frozenset(("view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze", "to", "_to_copy",
                     "clone", "contiguous", "alias", "detach", "long", "int", "expand", "slice", "getitem"))


def _computed_by(indices: fx.Node) -> str | None:
    """The first op that computes ``indices`` from the inputs (positions), or None for token ids as given."""
    node = indices
    while node.op == "call_function" and op_name(node) in _ID_OPS:
        node = node.args[0]
    if node.op == "placeholder":
        return None
    return op_name(node) if node.op == "call_function" else node.op


def _reject(rejected: dict | None, node: fx.Node, why: str) -> None:
    """Log that ``node`` stays replicated and record why in ``rejected`` (autopar.coverage reads it)."""
    log.warning("tensor parallel: %s stays replicated (node %s): %s", module_path(node), node.name, why)
    if rejected is not None:
        rejected[node] = why


def _position_reason(node: fx.Node) -> str | None:
    """Why ``node`` is a position table (its indices are not token ids), or None for a token embedding."""
    indices = node.args[1]
    if not _reads_input(indices):
        return "a position or type table (constant indices, not token ids): replicated, as in Megatron-LM"
    op = _computed_by(indices)
    if op is not None:
        return f"a position or type table (indices computed by aten.{op}, not token ids): replicated, as in Megatron-LM"
    return None


def _token_embeddings(gm: fx.GraphModule, rejected: dict | None = None) -> list[fx.Node]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        if not _is_param(node.args[0]):
            continue
        position = _position_reason(node)
        if position is not None:  # small, read whole by every rank: no gain from sharding it
            log.info("tensor parallel: embedding %s stays replicated: %s", module_path(node), position)
            if rejected is not None:
                rejected[node] = position
            continue
        if _arg(node, 3, "scale_grad_by_freq", False) or _arg(node, 4, "sparse", False):
            _reject(rejected, node, "scale_grad_by_freq and sparse embeddings are not supported on a vocabulary "
                                    "shard")
            continue
        found.append(node)
    return found


class _Reject(Exception):
    """This linear is not a vocabulary head (the reason in the message)."""


def _loss_reason(node: fx.Node) -> str | None:
    """Why ``cross_entropy_loss`` cannot run on vocabulary shards, or None when it can."""
    if _arg(node, 2, "weight", None) is not None:
        return "cross_entropy_loss has class weights"
    if _arg(node, 3, "reduction", _MEAN) not in _REDUCTIONS:
        return "cross_entropy_loss reduction is neither 'mean' nor 'sum'"
    if _arg(node, 5, "label_smoothing", 0.0) != 0.0:
        return f"cross_entropy_loss uses label_smoothing={_arg(node, 5, 'label_smoothing', 0.0)}"
    if len(shape_of(node.args[0])) != 2:
        return "cross_entropy_loss logits are not 2-D (rows, classes)"
    info = get_meta(node.args[1], TENSOR)
    if info is None or info.dtype is None or info.dtype.is_floating_point:
        return "cross_entropy_loss targets are probabilities, not class indices"
    return None


def _trace_head(linear: fx.Node) -> VocabParallel:
    """Follow a vocab-sharded head output through rule-covered ops to losses and the output."""
    vp = VocabParallel(head=linear)
    carriers = grad_carriers(linear.graph.owning_module)
    vp.chain[linear] = Placement.shard(len(shape_of(linear)) - 1)
    queue = [linear]
    while queue:
        src = queue.pop(0)
        for user in src.users:
            if user in vp.chain or user in vp.losses:
                continue
            if user.op == "output":
                vp.outputs.append(src)
            elif user.op == "call_function" and op_name(user) == "cross_entropy_loss":
                reason = _loss_reason(user)
                if user.args[0] is not src or vp.chain[src] != Placement.shard(1) or reason:
                    raise _Reject(reason or f"{user.name} does not take the logits on their class dim")
                vp.losses.append(user)
            else:
                try:
                    out, need = rule_for(user)(user, vp.chain)
                except NoRule as why:
                    raise _Reject(f"{user.name} ({op_name(user) if user.op == 'call_function' else user.op})"
                                  f" cannot take vocabulary-sharded logits: {why}") from None
                missing = {n: p for n, p in need.items() if p != REPLICATE and n not in vp.chain}
                if any(n in carriers for n in missing):
                    raise _Reject(f"{user.name} would need another sharded input")
                vp.local_slices.update(missing)  # a buffer or constant: each rank reads its own slice
                vp.chain[user] = out
                queue.append(user)
    return vp


def _find_head(gm: fx.GraphModule, vocab_sizes: set[int], rejected: dict | None = None) -> VocabParallel | None:
    """The last parameter linear before the loss (or, without one, before the output)."""
    has_loss = any(n.op == "call_function" and op_name(n) == "cross_entropy_loss" for n in gm.graph.nodes)
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or op_name(node) != "linear" or not _is_param(node.args[1]):
            continue
        if (has_loss and not _reaches_loss(node)) or (not has_loss and shape_of(node)[-1] not in vocab_sizes):
            continue
        try:
            vp = _trace_head(node)
        except _Reject as why:
            _reject(rejected, node, f"LM head: {why}")
            return None
        if has_loss and not vp.losses:
            _reject(rejected, node, "LM head: its logits reach the graph output but no cross_entropy_loss")
            return None
        return vp if vp.losses or vp.outputs else None
    return None


def _reaches_loss(node: fx.Node) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "call_function" and op_name(n) == "cross_entropy_loss":
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return False


def _divisible(vp: VocabParallel, *, tp_size: int, vocab_sizes: set[int], strict: bool,
               rejected: dict | None = None) -> VocabParallel:
    """Drop what does not divide by tp: a classifier head always, a vocabulary unless ``strict``."""
    classes = shape_of(vp.head)[-1] if vp.head is not None else 0
    if classes % tp_size and (classes not in vocab_sizes or not strict):
        what = f"vocabulary of {classes} does" if classes in vocab_sizes else f"{classes} classes do"
        _reject(rejected, vp.head, f"head: its {what} not divide by tp={tp_size} (pad the vocabulary to a "
                                   "multiple of tp to shard it)")
        weight = vp.head.args[1]
        vp = VocabParallel(embeddings=[e for e in vp.embeddings if e.args[0] is not weight])
    kept = []
    for emb in vp.embeddings:
        rows = shape_of(emb.args[0])[0]
        if rows % tp_size and not strict:
            _reject(rejected, emb, f"embedding: its vocabulary of {rows} does not divide by tp={tp_size} (pad it "
                                   "to a multiple of tp to shard it)")
            continue
        kept.append(emb)
    vp.embeddings = kept
    return vp


def find_vocab_parallel(gm: fx.GraphModule, *, tp_size: int | None = None, strict: bool = False,
                        rejected: dict | None = None) -> VocabParallel:
    """The token embeddings and LM head of ``gm`` that shard on the vocabulary (may be empty).

    With ``tp_size``, whatever does not divide by tp stays replicated with a warning, except a
    vocabulary when ``strict`` (the user asked for ``vocab_parallel=True``): that raises
    :class:`ShardingError` when the pass shards it. A classifier head (no token embedding has
    its width) never raises. ``rejected`` receives {node: why it stays replicated} (autopar.coverage).
    """
    embeddings = _token_embeddings(gm, rejected)
    vocab_sizes = {shape_of(e.args[0])[0] for e in embeddings}
    vp = _find_head(gm, vocab_sizes, rejected) or VocabParallel()
    head_weight = vp.head.args[1] if vp.head is not None else None
    for emb in embeddings:
        weight = emb.args[0]
        others = [u for u in weight.users if u is not emb and u not in embeddings]  # (T5: encoder and decoder)
        if any(u is not vp.head or u.args[1] is not weight for u in others):
            _reject(rejected, emb, f"embedding: its weight {weight.target} is also read by "
                                   f"{[module_path(u) for u in others]}, which is not a vocabulary-parallel head")
            continue
        vp.embeddings.append(emb)
    if vp.head is not None and head_weight is not None:
        tied_to_replicated = [u for u in head_weight.users if u is not vp.head and u not in vp.embeddings]
        if tied_to_replicated:
            _reject(rejected, vp.head, f"LM head: its weight is also read by "
                                       f"{[module_path(u) for u in tied_to_replicated]}")
            vp.head, vp.chain, vp.losses, vp.outputs = None, {}, [], []
    return _divisible(vp, tp_size=tp_size, vocab_sizes=vocab_sizes, strict=strict,
                      rejected=rejected) if tp_size else vp


# -- the rewrite --------------------------------------------------------------------------------
def _copy_meta(new: fx.Node, like: fx.Node) -> None:
    new.meta.update({k: v for k, v in like.meta.items() if k in ("nn_module_stack", MODULE)})


_ROWS = ShardLayout(0)  # the vocabulary: rows of an embedding or head weight (and the head's bias)


def _vocab_range(weight: fx.Node, user: fx.Node, *, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The rows ``[start, end)`` of the vocabulary that ``tp_rank`` holds."""
    vocab = shape_of(weight)[0]
    if _ROWS.misfit(shape_of(weight), tp_size):
        raise ShardingError(
            f"vocabulary size {vocab} of {weight.target} is not divisible by tp={tp_size}",
            where=node_where(user),
            fix=f"pad the vocabulary to a multiple of {tp_size} (e.g. {-(-vocab // tp_size) * tp_size}), "
                f"set vocab_parallel=False, or change the mesh dim 'tp'")
    (start, end), = _ROWS.ranges(shape_of(weight), rank=tp_rank, size=tp_size)[0]
    return start, end


def _shard_embedding(gm: fx.GraphModule, emb: fx.Node, *, start: int, end: int, tp_size: int, name: str):
    """Masked lookup of rows [start, end), zeros elsewhere, then an all-reduce (TpReduce)."""
    weight, idx = emb.args[0], emb.args[1]
    padding = _arg(emb, 2, "padding_idx", -1)
    # the padding row's gradient stays zero: the rank holding it looks it up as its local padding row
    local_padding = padding - start if start <= padding < end else -1
    gm.add_submodule(name, TpReduce(axis="tp", size=tp_size))
    g = gm.graph

    def op(name, target, *args):
        return g.create_node("call_function", target, args, {}, name=name)

    with g.inserting_before(emb):
        below = op("vocab_below", aten.lt.Scalar, idx, start)
        above = op("vocab_above", aten.ge.Scalar, idx, end)
        outside = op("vocab_outside", aten.bitwise_or.Tensor, below, above)
        shifted = op("vocab_shifted", aten.sub.Scalar, idx, start)
        local = op("vocab_local_ids", aten.masked_fill.Scalar, shifted, outside, 0)
        lookup = op("vocab_lookup", aten.embedding.default, weight, local, *([local_padding] if padding != -1 else []))
        mask = op("vocab_mask", aten.unsqueeze.default, outside, -1)
        partial = op("vocab_partial", aten.masked_fill.Scalar, lookup, mask, 0.0)
        reduced = g.call_module(name, (partial,))
    for n in (below, above, outside, shifted, local, lookup, mask, partial, reduced):
        _copy_meta(n, emb)
    set_meta(partial, TP_PLACEMENT, Placement("P"))
    emb.replace_all_uses_with(reduced)
    g.erase_node(emb)


def _shard_head(gm: fx.GraphModule, vp: VocabParallel, *, start: int, end: int, tp_size: int, tp_rank: int) -> None:
    g, head = gm.graph, vp.head
    gm.add_submodule("vocab_copy", TpCopy(axis="tp", size=tp_size))
    with g.inserting_before(head):
        copy = g.call_module("vocab_copy", (head.args[0],))
    _copy_meta(copy, head)
    head.args = (copy, *head.args[1:])
    for node, p in vp.chain.items():
        set_meta(node, TP_PLACEMENT, p)
        if node is not head:
            localize_sizes(node, p, tp_size)
    insert_local_slices(gm, vp.local_slices, vp.chain, tp_rank=tp_rank, tp_size=tp_size)
    for i, loss in enumerate(vp.losses):
        name = f"vocab_cross_entropy_{i}" if i else "vocab_cross_entropy"
        ignore = _arg(loss, 4, "ignore_index", -100)
        gm.add_submodule(name, VocabParallelCrossEntropy(axis="tp", size=tp_size, vocab_start=start, vocab_end=end,
                                                         ignore_index=ignore,
                                                         reduction=_REDUCTIONS[_arg(loss, 3, "reduction", _MEAN)]))
        with g.inserting_before(loss):
            new = g.call_module(name, (loss.args[0], loss.args[1]))
        _copy_meta(new, loss)
        loss.replace_all_uses_with(new)
        g.erase_node(loss)
    output = next(n for n in g.nodes if n.op == "output")
    for i, value in enumerate(vp.outputs):
        name = f"vocab_gather_{i}" if i else "vocab_gather"
        gm.add_submodule(name, TpGather(axis="tp", size=tp_size, dim=vp.chain[value].dim))
        with g.inserting_before(output):
            gathered = g.call_module(name, (value,))
        _copy_meta(gathered, value)
        output.replace_input_with(value, gathered)


def shard_vocab_parallel(st: LoweringState) -> LoweringState:
    """Shard ``st.vocab``'s embeddings and head over the Plan's tp ranks (``specs`` gains them); the state as
    it was when nothing is sharded on the vocabulary."""
    gm, vp, tp_size, tp_rank = st.gm, st.vocab, st.plan.mesh.tp, st.tp_rank
    if not vp:
        return st
    specs: dict[str, ShardLayout] = {}
    for i, emb in enumerate(vp.embeddings):
        start, end = _vocab_range(emb.args[0], emb, tp_size=tp_size, tp_rank=tp_rank)
        specs[emb.args[0].target] = _ROWS
        _shard_embedding(gm, emb, start=start, end=end, tp_size=tp_size,
                         name=f"vocab_reduce_{i}" if i else "vocab_reduce")
    if vp.head is not None:
        start, end = _vocab_range(vp.head.args[1], vp.head, tp_size=tp_size, tp_rank=tp_rank)
        specs[vp.head.args[1].target] = _ROWS
        bias = _arg(vp.head, 2, "bias", None)
        if isinstance(bias, fx.Node):
            specs[bias.target] = _ROWS
        _shard_head(gm, vp, start=start, end=end, tp_size=tp_size, tp_rank=tp_rank)
    for target, spec in specs.items():
        set_param(gm, target, spec.cut(gm.get_parameter(target).detach(), rank=tp_rank, size=tp_size))
    gm.graph.lint()
    gm.recompile()
    log.info("tensor parallel: vocabulary-parallel %s", list(vp.paths()))
    return dataclasses.replace(st, gm=gm, specs={**st.specs, **specs})
