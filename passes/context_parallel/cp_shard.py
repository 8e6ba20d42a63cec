"""Transform: cut the sequence of a captured graph over the cp ranks (context parallelism).

Reads what the two analyses of this package find, right before it (:func:`annotate_attention`,
``autopar.attention``; :func:`annotate_sequence`, ``autopar.seq``) and rewrites the graph into the program of
cp rank ``coords["cp"]``, whose sequence inputs hold that rank's shard (:class:`CpLayout`: load-balanced,
chunks i and 2cp-1-i, unless the Plan says ``cp_load_balanced=False``):

1. every refusal of the sequence analysis, and every rule not wired yet (reductions and scans over the
   sequence, label shifts other than the labels' own, dense masks, learned biases), raises :class:`ShardingError`
   naming the node, its module path and the fix: at plan time, never a wrong loss;
2. each recognised attention becomes one :class:`RingAttention` or :class:`UlyssesAttention` node
   (``cp_strategy``; ``auto``: the all-to-all where the heads per tp rank divide by cp, else the ring), its
   q, k, v permuted to ``[B, H, L, D]``, the mask given as rules (causal, window, soft-cap, ALiBi), the key
   padding as the ``valid`` vector and packed documents as ``docs`` (a token's global position minus its
   position id: the same for every token of a document, across shards); the mask builders die with it;
3. every ``positions`` producer (an ``arange`` over the sequence) yields the rank's global positions, so
   the ``positional`` values after it (rotary tables, position embeddings) follow; a table read whole along
   the sequence (a rotary cache's first S rows) is read at those positions (``index_select``);
4. a label shift inside the model's own loss (``pad(labels, (0, k))[..., k:]``) reads the labels as they come:
   the runtime shifts the whole sequence before the cut (``plan.cp_label_shifts``), so the last token of a
   shard predicts the first of the next;
5. a sum or a mean over the sequence (pooling) is all-reduced over cp (``TpReduce`` then ``TpCopy`` on the
   axis ``cp``: forward and backward), a mean divided by cp;
6. every literal sequence length in a shape argument (``view``, ``reshape``, ``expand``, ``new_zeros``, ...)
   on a value carrying the sequence becomes the local length.

What crosses ranks besides attention is the runtime's (runtime/execution/cp_batch.py): the batch cut, the
token count of the loss and the weights' gradients over dp x cp.

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.plan_model import MeshShape
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> st = LoweringState.of_graph(gm, mesh=MeshShape(cp=2), example_inputs=(x, y), global_batch_size=8)
    >>> st = shard_context_parallel(st)
    >>> [n.target for n in st.gm.graph.nodes if n.op == "call_module"], st.cp_inputs, tuple(st.example_args[0].shape)
    (['cp_attention_0', 'cp_attention_1'], (('idx', 1), ('target', 1)), (8, 16))
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from autopar.errors import PlanError, ShardingError
from autopar.ir.meta_keys import ATTENTION, SEQ, AttentionInfo
from autopar.ops.collectives import TpCopy, TpReduce
from autopar.ops.context_parallel.block_math import AttentionSpec
from autopar.ops.context_parallel.layout import CpLayout
from autopar.ops.context_parallel.ring import RingAttention
from autopar.ops.context_parallel.ulysses import UlyssesAttention
from autopar.passes.context_parallel.attention import AttentionReport, annotate_attention
from autopar.passes.context_parallel.graph_util import shape, value
from autopar.passes.context_parallel.seq_dims import SeqReport, annotate_sequence, default_seq_inputs
from autopar.passes.frontend.annotate import module_path_of
from autopar.passes.lowering_state import LoweringState

__all__ = ["shard_context_parallel", "sequence_inputs", "NOT_WIRED"]

log = logging.getLogger(__name__)

aten = torch.ops.aten

#: rules of the sequence analysis this pass does not realise yet: each a refusal naming the node
NOT_WIRED = {
    "reduce": "a reduction over the sequence other than a sum or a mean (max, var, logsumexp, ...) needs its own "
              "all-reduce over cp, not wired yet",
    "scan": "a running sum or product along the sequence needs an exclusive scan over cp, not wired yet",
    "label_shift": "a shift along the sequence inside the graph needs the next shard's first positions, not "
                   "wired yet",
}
# ops whose shape argument (its index) may hold the sequence length as a literal
_SHAPE_ARG = {"view": 1, "reshape": 1, "_unsafe_view": 1, "expand": 1, "new_zeros": 1, "new_ones": 1,
              "new_empty": 1, "new_full": 1, "zeros": 0, "ones": 0, "empty": 0, "full": 0, "broadcast_to": 1}
# reductions over the sequence made whole by an all-reduce over cp (scatter_add: sums of positions into bins)
_ALL_REDUCED = ("sum", "mean", "scatter_add", "scatter_add_")
_RANDOM = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "rand_like",
           "randn_like", "randint_like")


def _op(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    target = node.target
    name = getattr(target, "__name__", str(target))
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", name).split(".")[0]


def _where(gm: fx.GraphModule, node: fx.Node) -> str:
    return f"node {node.name} ({module_path_of(node) or 'the model'})"


def sequence_inputs(gm: fx.GraphModule) -> tuple[int, dict[str, int]]:
    """(sequence length, ``{input: its sequence dim}``): the first input's dim 1, and every input holding it."""
    first = next((n for n in gm.graph.nodes if n.op == "placeholder" and len(shape(n) or ()) >= 2), None)
    if first is None:
        raise ShardingError("context parallelism found no input with a sequence dim (batch, sequence, ...)",
                            where="the graph's inputs", fix="pass token inputs shaped (batch, sequence), or drop cp")
    seq_len = int(shape(first)[1])
    return seq_len, default_seq_inputs(gm, seq_len=seq_len)


def _input_shifts(gm: fx.GraphModule, seq: SeqReport, seq_inputs: dict[str, int]) -> dict[str, tuple]:
    """{slice node: (input, k, fill)} of each ``pad(input, (0, k), value=fill)[..., k:]`` on the sequence: a causal
    LM's labels shifted inside its own loss (transformers' ``ForCausalLMLoss``). The runtime shifts the whole
    sequence before the cut (runtime/execution/cp_batch.py), so each rank's slice is its shifted labels as cut."""
    infos, out = dict(seq.infos), {}
    for node in gm.graph.nodes:
        if infos[node.name].rule != "label_shift" or _op(node) != "slice" or not isinstance(node.args[0], fx.Node):
            continue
        pad, (dim, start) = node.args[0], node.args[1:3]
        end = node.args[3] if len(node.args) > 3 else None
        if _op(pad) != "pad" or len(pad.users) != 1 or not isinstance(pad.args[0], fx.Node):
            continue
        source, widths = pad.args[0], list(pad.args[1])
        seq_dim = seq_inputs.get(source.name)
        full = shape(source)
        if (source.op != "placeholder" or seq_dim is None or len(full) != seq_dim + 1 or dim not in (seq_dim, -1)
                or widths[:1] != [0] or len(widths) != 2 or widths[1] != start or start < 1
                or (end is not None and end < full[seq_dim] + start)):
            continue
        fill = pad.args[3] if len(pad.args) > 3 else pad.kwargs.get("value", 0.0)
        out[node.name] = (source.name, int(start), float(fill or 0.0))
    return out


def _draws(node: fx.Node) -> bool:
    """Does this random op draw anything (a dropout with p = 0, or outside training, does not)?"""
    if _op(node) in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout"):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return bool(train) and p != 0
    return True


def _label_counts(gm: fx.GraphModule, st: LoweringState) -> set[str]:
    """The count of a call's own label tokens that capture puts in a reweighted loss (``mean · n / count``,
    passes/frontend/capture.py): ``sum(labels != ignore)`` over the rank's labels makes ``mean · n`` the
    rank's sum, exact under cp (the runtime's count is over dp x cp)."""
    spec = st.captured.item_count if st.captured is not None else None
    if spec is None or spec.shift:
        return set()
    return {n.name for n in gm.graph.nodes if _op(n) == "sum" and isinstance(n.args[0], fx.Node)
            and _op(n.args[0]) == "ne" and getattr(n.args[0].args[0], "name", None) == spec.labels
            and n.args[0].args[1] == spec.ignore_index}


def _refuse(gm: fx.GraphModule, seq: SeqReport, attention: AttentionReport, shifts: dict[str, tuple],
            exact: set[str] = frozenset()) -> None:
    """Every refusal, and every rule not wired yet, as one ShardingError (the first named, the count given);
    ``exact``: reductions known exact on the rank's part."""
    problems = [(r.node, r.path or "the model", r.reason, r.fix) for r in seq.refusals]
    nodes = {n.name: n for n in gm.graph.nodes}
    realised = set(shifts) | {nodes[s].args[0].name for s in shifts} | set(exact)  # (the shifts' pads and slices)
    for name, info in seq.infos:
        if name in realised or (info.rule == "reduce" and _op(nodes[name]) in _ALL_REDUCED):
            continue
        if info.rule in NOT_WIRED:
            problems.append((name, module_path_of(nodes[name]) or "the model", NOT_WIRED[info.rule],
                             "drop cp for this model, or rewrite the op position by position"))
        elif _op(nodes[name]) in _RANDOM and info.rule != "attention" and _draws(nodes[name]):
            problems.append((name, module_path_of(nodes[name]) or "the model",
                             "a random op on sequence shards: one device's mask cannot be reproduced",
                             "set the model's dropout to 0 for cp > 1"))
    if problems:
        node, path, reason, fix = problems[0]
        more = f" (and {len(problems) - 1} more: {', '.join(p[0] for p in problems[1:4])})" if len(problems) > 1 else ""
        raise ShardingError(f"context parallelism cannot cut the sequence at node {node}: {reason}{more}",
                            where=f"node {node} ({path})", fix=fix)
    if not attention.found:
        raise ShardingError("context parallelism found no attention in the graph"
                            + (f"; not recognised: {attention.unrecognised[0].node} "
                               f"({attention.unrecognised[0].reason})" if attention.unrecognised else ""),
                            where="the captured graph", fix="drop cp: without attention, use dp")


def _spec(gm: fx.GraphModule, info: AttentionInfo, output: fx.Node) -> tuple[AttentionSpec, str | None, str | None]:
    """The attention's rules, the input whose zeros mask keys and the positions input whose restarts part
    documents (None: none)."""
    padding, slopes, documents = None, None, None
    for m in info.masks:
        why = None
        if m.pattern == "dense" and m.documents is None:
            why = "a dense mask (neither causal, a window nor full) is not wired yet"
        elif m.bias in ("learned", "other"):
            why = f"an additive {m.bias} bias on the scores is not wired yet"
        if why:
            raise ShardingError(f"context parallelism cannot take the mask {m.node} of attention {info.output}: {why}",
                                where=_where(gm, output), fix="drop cp for this model")
        padding = m.padding or padding
        slopes = m.alibi_slopes or slopes
        documents = m.documents or documents
    spec = AttentionSpec(scale=info.scale, causal=info.causal, window=info.window, softcap=info.softcap,
                         alibi_slopes=tuple(slopes) if slopes else None)
    return spec, padding, documents


def _strategy(gm: fx.GraphModule, st: LoweringState, info: AttentionInfo, output: fx.Node) -> str:
    """``ring`` or ``all_to_all`` for this attention: the Plan's, or (``auto``) by what divides."""
    cp, tp = st.plan.mesh.cp, st.plan.mesh.tp if st.plan.mesh.tp > 1 else 1
    heads = info.num_heads // tp if info.num_heads % tp == 0 else info.num_heads
    splits = heads % cp == 0
    if st.plan.cp_strategy == "all_to_all" and not splits:
        raise ShardingError(f"all-to-all attention needs the query heads per tp rank ({heads}) to divide by cp={cp}",
                            where=_where(gm, output),
                            fix="use cp_strategy='ring' (or 'auto'), or a cp that divides the heads")
    if st.plan.cp_strategy == "auto":
        return "all_to_all" if splits else "ring"
    return st.plan.cp_strategy


def _permuted(graph: fx.Graph, node: fx.Node, layout, *, inverse: bool = False) -> fx.Node:
    perm = (layout.batch, layout.heads, layout.seq, layout.feature)
    if inverse:
        perm = tuple(perm.index(i) for i in range(4))
    return node if perm == (0, 1, 2, 3) else graph.call_function(aten.permute.default, (node, list(perm)))


def _strided_like(graph: fx.Graph, node: fx.Node, like: fx.Node) -> fx.Node:
    """``node`` stored in the memory order of ``like``'s value (SDPA returns ``[B, H, L, D]`` stored as
    ``[B, L, H, D]``, and the graph's later ``view`` relies on it)."""
    val = value(like)
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.is_contiguous():
        return node
    order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))  # outermost first
    back = [order.index(d) for d in range(val.dim())]
    stored = graph.call_function(aten.clone.default, (graph.call_function(aten.permute.default, (node, order)),),
                                 {"memory_format": torch.contiguous_format})
    return graph.call_function(aten.permute.default, (stored, back))


def _device(node: fx.Node):
    val = value(node)
    return val.device if isinstance(val, torch.Tensor) and val.device.type != "meta" else None


def _positions_node(graph: fx.Graph, layout: CpLayout, rank: int, **kwargs) -> fx.Node:
    """A node of the rank's global positions (int64, one run per chunk it holds)."""
    runs = [graph.call_function(aten.arange.start, (s, s + n), kwargs) for s, n in layout.runs(rank)]
    return runs[0] if len(runs) == 1 else graph.call_function(aten.cat.default, (runs,))


def _replace_attention(gm: fx.GraphModule, st: LoweringState, info: AttentionInfo, index: int,
                       layout: CpLayout, rank: int) -> tuple[str, str]:
    """One attention as a cp op node; returns (its module path, the strategy taken)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    output = nodes[info.output]
    if info.q_layout.heads == info.q_layout.batch:
        raise ShardingError(f"attention {info.output} reads batch x heads in one dim (bmm): not wired for cp yet",
                            where=_where(gm, output), fix="drop cp for this model")
    spec, padding, documents = _spec(gm, info, output)
    strategy = _strategy(gm, st, info, output)
    op = RingAttention if strategy == "ring" else UlyssesAttention
    try:
        module = op(axis="cp", size=layout.cp, layout=layout, spec=spec, dropout=info.dropout)
    except ShardingError:
        raise
    except Exception as exc:  # the op's own PlanError (dropout), with the node named
        raise ShardingError(f"{getattr(exc, 'what', exc)}", where=_where(gm, output),
                            fix=getattr(exc, "fix", None) or "drop cp for this model") from None
    name = f"cp_attention_{index}"
    gm.add_submodule(name, module)
    graph = gm.graph
    with graph.inserting_before(output):
        q = _permuted(graph, nodes[info.q], info.q_layout)
        k = _permuted(graph, nodes[info.k], info.k_layout)
        v = _permuted(graph, nodes[info.v], info.v_layout)
        docs = None
        if documents is not None:  # packed rows: a document is the tokens sharing (global position - position id)
            pos = _positions_node(graph, layout, rank, device=_device(nodes[documents]))
            docs = graph.call_function(aten.sub.Tensor, (pos, nodes[documents]))
        valid = graph.call_function(aten.ne.Scalar, (nodes[padding], 0)) if padding is not None else None
        args = (q, k, v) if docs is None and valid is None else (q, k, v, None, docs, valid)
        out = graph.call_module(name, args)
        out = _strided_like(graph, _permuted(graph, out, info.q_layout, inverse=True), output)
    output.replace_all_uses_with(out)
    return module_path_of(output) or output.name, strategy


def _global_positions(gm: fx.GraphModule, names: list[str], layout: CpLayout, rank: int) -> None:
    """Each ``arange`` over the sequence yields the rank's global positions instead."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in names:
        node = nodes[name]
        if _op(node) != "arange":
            raise ShardingError(f"positions made by {node.target}, not an arange: not wired for cp yet",
                                where=_where(gm, node), fix="drop cp for this model")
        start = node.args[0] if len(node.args) >= 2 else 0
        step = node.args[2] if len(node.args) >= 3 else 1
        if step != 1 or not isinstance(start, int):
            raise ShardingError(f"an arange with step {step} over the sequence is not wired for cp yet",
                                where=_where(gm, node), fix="drop cp for this model")
        kwargs = dict(node.kwargs)
        with gm.graph.inserting_before(node):
            runs = [gm.graph.call_function(aten.arange.start, (start + s, start + s + n), kwargs)
                    for s, n in layout.runs(rank)]
            new = runs[0] if len(runs) == 1 else gm.graph.call_function(aten.cat.default, (runs,))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)


def _table_rows(gm: fx.GraphModule, seq: SeqReport, layout: CpLayout, rank: int) -> None:
    """A table spanning the sequence read as it is (a rotary table's first S rows, BERT's position rows): its
    rows at the rank's global positions instead (``index_select`` on the sequence dim)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, info in seq.infos:
        if info.rule != "positional" or not info.note.startswith("a table spanning"):
            continue
        node = nodes[name]
        users = list(node.users)
        first = next(n for n in gm.graph.nodes if n in node.users)
        with gm.graph.inserting_before(first):
            index = _positions_node(gm.graph, layout, rank, device=_device(node))
            rows = gm.graph.call_function(aten.index_select.default, (node, info.dim, index))
        for user in users:
            user.replace_input_with(node, rows)


def _local_sizes(gm: fx.GraphModule, seq: SeqReport, cp: int) -> None:
    """Literal sequence lengths in shape arguments become the local length (a merged dim: its 1/cp)."""
    infos = dict(seq.infos)
    for node in gm.graph.nodes:
        info, at, out = infos.get(node.name), _SHAPE_ARG.get(_op(node)), shape(node)
        if info is None or info.dim is None or at is None or out is None or len(node.args) <= at:
            continue
        sizes = node.args[at]
        if not isinstance(sizes, (list, tuple)) or len(sizes) <= info.dim:
            continue
        full = int(out[info.dim])
        if sizes[info.dim] == full:
            sizes = list(sizes)
            sizes[info.dim] = full // cp
            node.args = node.args[:at] + (sizes,) + node.args[at + 1:]


def _reduce_over_cp(gm: fx.GraphModule, seq: SeqReport, cp: int, exact: set[str]) -> int:
    """Each sum or mean over the sequence (pooling) made whole: all-reduced over cp forward and backward (every
    rank's loss reads the whole value, so its gradient sums theirs), a mean divided by cp (equal parts)."""
    infos, count = dict(seq.infos), 0
    for node in list(gm.graph.nodes):
        info = infos.get(node.name)
        if info is None or info.rule != "reduce" or node.name in exact or _op(node) not in _ALL_REDUCED:
            continue
        names = (f"cp_reduce_{count}", f"cp_reduce_grad_{count}")
        gm.add_submodule(names[0], TpReduce(axis="cp", size=cp))
        gm.add_submodule(names[1], TpCopy(axis="cp", size=cp))
        users = list(node.users)
        with gm.graph.inserting_after(node):
            summed = gm.graph.call_module(names[0], (node,))
        with gm.graph.inserting_after(summed):
            whole = gm.graph.call_module(names[1], (summed,))
        if _op(node) == "mean":
            with gm.graph.inserting_after(whole):
                whole = gm.graph.call_function(aten.div.Tensor, (whole, cp))
        for user in users:
            user.replace_input_with(node, whole)
        count += 1
    return count


def _rowwise_sizes(gm: fx.GraphModule, seq: SeqReport, tokens: int, cp: int) -> None:
    """Inside a module proven to compute each position alone (MoE routing: rows gathered and sorted), sizes
    counting the tokens (``view(x, [B * S, k, d])``, ``arange(B * S * k)``) become the rank's count."""
    infos = dict(seq.infos)

    def local(v):
        return v // cp if isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % tokens == 0 else v

    for node in gm.graph.nodes:
        info = infos.get(node.name)
        if info is None or info.rule != "rowwise" or info.dim is not None:
            continue
        at = _SHAPE_ARG.get(_op(node))
        if at is not None and len(node.args) > at and isinstance(node.args[at], (list, tuple)):
            node.args = node.args[:at] + ([local(v) for v in node.args[at]],) + node.args[at + 1:]
        elif _op(node) == "arange":
            node.args = tuple(local(v) for v in node.args)


def shard_context_parallel(st: LoweringState) -> LoweringState:
    """The graph of cp rank ``coords["cp"]``: attention by ring or all-to-all, positions global, sizes local."""
    gm, cp, rank = st.gm, st.plan.mesh.cp, st.coords.get("cp", 0)
    seq_len, seq_inputs = sequence_inputs(gm)
    try:
        layout = CpLayout(seq_len=seq_len, cp=cp, load_balanced=st.plan.cp_load_balanced)
    except PlanError as exc:  # a length not dividing by 2 x cp: name the inputs that carry it
        where = ", ".join(f"input {name} (dim {dim})" for name, dim in seq_inputs.items())
        raise PlanError(exc.what, where=f"{where}; {exc.where}", fix=exc.fix) from None
    attention = annotate_attention(gm)
    seq = annotate_sequence(gm, seq_inputs=seq_inputs, attention=attention)
    shifts = _input_shifts(gm, seq, seq_inputs)
    exact = _label_counts(gm, st)
    _refuse(gm, seq, attention, shifts, exact)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, (source, _, _) in shifts.items():  # the runtime hands the rank its labels already shifted
        nodes[name].replace_all_uses_with(nodes[source])
    strategies = [_replace_attention(gm, st, info, i, layout, rank) for i, info in enumerate(attention.found)]
    _global_positions(gm, seq.with_rule("positions"), layout, rank)
    _table_rows(gm, seq, layout, rank)
    _local_sizes(gm, seq, cp)
    rows = next(shape(n)[0] for n in gm.graph.nodes if n.op == "placeholder" and n.name in seq_inputs)
    _rowwise_sizes(gm, seq, rows * seq_len, cp)
    _reduce_over_cp(gm, seq, cp, exact)
    replaced = {name for info in attention.found for name in info.nodes + (info.output,)}
    for node in reversed(list(gm.graph.nodes)):  # (SDPA counts as impure for dead-code elimination: a dropout)
        if node.name in replaced and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    for node in gm.graph.nodes:  # stale now: the graph holds the rank's shard
        node.meta.pop(SEQ, None)
        node.meta.pop(ATTENTION, None)
    gm.recompile()
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    args = tuple(layout.shard(a, dim=seq_inputs[name], rank=rank) if name in seq_inputs else a
                 for name, a in zip(placeholders, st.example_args))
    log.info("cp=%d rank %d: %d attentions (%s), sequence %d -> %d", cp, rank, len(strategies),
             ", ".join(sorted({s for _, s in strategies})), seq_len, layout.local_len)
    return dataclasses.replace(st, gm=gm, example_args=args, cp_inputs=tuple(seq_inputs.items()), cp_seq_len=seq_len,
                               cp_label_shifts=tuple(sorted(set(shifts.values()))), cp_attention=tuple(strategies))
