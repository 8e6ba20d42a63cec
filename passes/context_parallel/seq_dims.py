"""Analysis: follow the sequence through a captured graph and say what context parallelism does at each node.

Given which inputs are cut on the sequence (``input_ids``, ``labels``, ``position_ids``, the query side
of ``attention_mask``: their sequence dim), a :class:`~autopar.passes.context_parallel.seq_place.Place`
is propagated forward in graph order by the rules of
:mod:`~autopar.passes.context_parallel.seq_rules`, and every node gets a
:class:`~autopar.ir.meta_keys.SeqInfo` (``autopar.seq``) naming the rule that placed it:

- ``input``: a graph input cut on the sequence; ``replicated``: no sequence in it;
- ``pointwise``: follows the shard; ``positional`` / ``positions``: computed from positions alone / an
  ``arange`` over the sequence: under cp they must yield the rank's *global* positions
  (:meth:`~autopar.ops.context_parallel.layout.CpLayout.positions`);
- ``attention``: a node of a recognised attention (:mod:`~autopar.passes.context_parallel.attention`),
  replaced by the ring or all-to-all op; ``attention_mask``: a node that only builds attention masks or
  biases (rows at the rank's query positions, columns over every key: the attention op takes them);
- ``label_shift``, ``reduce``, ``scan``, ``loss``: see the rules module; ``refused``: cp cannot shard it.

A refusal names the node, its module path, why and the fix; nothing after a refused node is placed
from it. The analysis writes meta only and rewrites nothing.

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> report = analyze_sequence(gm, seq_inputs={"idx": 1, "target": 1})
    >>> report.refusals, sorted(set(info.rule for _, info in report.infos))
    ((), ['attention', 'input', 'loss', 'pointwise', 'positional', 'positions', 'replicated'])
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir.meta_keys import SEQ, SeqInfo, set_meta
from autopar.passes.frontend.annotate import module_path_of
from autopar.passes.context_parallel.attention import AttentionReport, find_attention
from autopar.passes.context_parallel.graph_util import ancestors, is_op, param_of, shape
from autopar.passes.context_parallel.rowwise import find_unit
from autopar.passes.context_parallel.seq_place import Place
from autopar.passes.context_parallel.seq_rules import RULES, Outcome, Reader, Refuse, family

__all__ = ["Refusal", "SeqReport", "analyze_sequence", "annotate_sequence", "default_seq_inputs"]

_ASSERTS = ("_assert_tensor_metadata", "_assert_async", "_functional_assert_async", "_assert_scalar",
            "_functional_assert_scalar", "sym_size", "sym_numel", "sym_stride")


@dataclass(frozen=True)
class Refusal:
    """A node cp cannot shard on the sequence: where, why and what to do."""

    node: str
    path: str
    reason: str
    fix: str


@dataclass(frozen=True)
class SeqReport:
    """Every node's :class:`SeqInfo` (graph order) and the refusals."""

    infos: tuple[tuple[str, SeqInfo], ...]
    refusals: tuple[Refusal, ...]

    def info(self, name: str) -> SeqInfo:
        return dict(self.infos)[name]

    def with_rule(self, rule: str) -> list[str]:
        """The nodes placed by ``rule``, in graph order."""
        return [name for name, info in self.infos if info.rule == rule]


def default_seq_inputs(gm: fx.GraphModule, *, seq_len: int, dim: int = 1) -> dict[str, int]:
    """Every graph input with ``seq_len`` positions on ``dim`` (batch-first token inputs): ``{name: dim}``."""
    return {n.name: dim for n in gm.graph.nodes
            if n.op == "placeholder" and len(shape(n) or ()) > dim and shape(n)[dim] == seq_len}


def _seq_len(gm: fx.GraphModule, seq_inputs: Mapping[str, int]) -> int:
    sizes = {name: shape(n)[seq_inputs[name]] for n in gm.graph.nodes if n.op == "placeholder"
             for name in [n.name] if name in seq_inputs and shape(n)}
    missing = set(seq_inputs) - set(sizes)
    if missing or len(set(sizes.values())) != 1:
        raise PlanError(f"the sequence inputs disagree or are missing: {sizes}, missing {sorted(missing)}",
                        where="the sequence analysis (passes/context_parallel/seq_dims.py)",
                        fix="name graph inputs (the model's forward arguments) and the dim of each that holds the "
                            "sequence; every one must hold the same length")
    return next(iter(sizes.values()))


def _mask_only(gm: fx.GraphModule, terms: set[str]) -> set[fx.Node]:
    """Nodes whose every use ends in an attention's mask or bias term (the mask builders)."""
    marked: set[fx.Node] = set()
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.name in terms or (node.users and all(u in marked for u in node.users)):
            marked.add(node)
    return marked


class _Walk:
    """One propagation over the graph: places, infos and refusals as it goes."""

    def __init__(self, gm, *, seq_inputs, positions, attention: AttentionReport):
        self.gm, self.seq_inputs, self.positions = gm, dict(seq_inputs), set(positions)
        self.seq_len = _seq_len(gm, self.seq_inputs)
        self.places: dict[fx.Node, Place] = {}
        self.reader = Reader(self.places, self.seq_len)
        self.infos: dict[fx.Node, SeqInfo] = {}
        self.refusals: list[Refusal] = []
        self.done: set[fx.Node] = set()  # nodes a row-wise unit placed
        self.outputs = {a.output: a for a in attention.found}
        self.internal = {name for a in attention.found for name in a.nodes} - set(self.outputs)
        self.masks = _mask_only(gm, {m.node for a in attention.found for m in a.masks})

    def refuse(self, node: fx.Node, reason: str, fix: str) -> None:
        self.refusals.append(Refusal(node.name, module_path_of(node), reason, fix))
        self.infos[node] = SeqInfo("refused", None, reason)

    def run(self) -> SeqReport:
        for node in self.gm.graph.nodes:
            self.visit(node)
        return SeqReport(infos=tuple((n.name, self.infos[n]) for n in self.gm.graph.nodes),
                         refusals=tuple(self.refusals))

    def visit(self, node: fx.Node) -> None:
        if node in self.done:
            return
        if node.op == "placeholder" and node.name in self.seq_inputs:
            kind = "pos" if node.name in self.positions else "shard"
            self.places[node] = Place(self.seq_inputs[node.name], self.seq_len, kind=kind)
            self.infos[node] = SeqInfo("input", self.seq_inputs[node.name], "cut on the sequence by the cp layout" + (
                ": the rank's global positions" if kind == "pos" else ""))
        elif node.op != "call_function" or is_op(node, *_ASSERTS):
            self.infos[node] = SeqInfo("replicated")
        elif node in self.masks:
            self.infos[node] = SeqInfo("attention_mask", None, "builds an attention's mask or bias: rows at the rank's "
                                                               "query positions, columns over every key")
        elif node.name in self.internal:
            self.infos[node] = SeqInfo("attention", None, "inside an attention that the cp op replaces")
        elif node.name in self.outputs:
            self.attention(node, self.outputs[node.name])
        else:
            self.op(node)

    def attention(self, node: fx.Node, info) -> None:
        by_name = {n.name: n for n in node.graph.nodes}
        for role, name, layout in (("q", info.q, info.q_layout), ("k", info.k, info.k_layout),
                                   ("v", info.v, info.v_layout)):
            p = self.places.get(by_name[name])
            if p is None or p.dim != layout.seq or p.outer != 1 or p.inner != 1:
                return self.refuse(node, f"the attention's {role} ({name}) is not cut on its sequence dim "
                                         f"{layout.seq} (cross-attention, or a sequence the inputs do not carry)",
                                   "keep cp=1 for this model, or declare the input that carries this sequence")
        q_place = self.places[by_name[info.q]]
        self.places[node] = q_place
        self.infos[node] = SeqInfo("attention", q_place.dim, "the attention's output: ring or all-to-all attention "
                                                             "over cp computes it on the rank's query positions")

    def op(self, node: fx.Node) -> None:
        if not self.reader.placed_args(node):
            self.unplaced(node)
            return
        rule = RULES.get(family(node))
        try:
            if rule is None:
                raise Refuse(f"no sequence rule for op {family(node)} on a sequence-sharded value",
                             "keep cp=1 for this model, or add the op's rule to passes/context_parallel/seq_rules.py")
            outcome: Outcome = rule(node, self.reader)
        except Refuse as refusal:
            self.reader.positional.clear()
            unit = find_unit(self.gm, node, self.places)
            return self.rowwise(unit) if unit is not None else self.refuse(node, refusal.reason, refusal.fix)
        self.positional(node)
        for base in self.reader.written:
            self.infos[base] = SeqInfo("pointwise", self.places[base].dim, "filled by copying a sequence-sharded value in")
        self.reader.written.clear()
        if outcome.place is not None:
            self.places[node] = outcome.place
        self.infos[node] = SeqInfo(outcome.rule, outcome.place.dim if outcome.place else None, outcome.note)

    def rowwise(self, unit) -> None:
        """Every node of a row-wise module (rowwise.py) follows the shard as one unit."""
        place = self.places[unit.x]
        self.done |= set(unit.nodes)
        for node in unit.nodes:
            self.infos[node] = SeqInfo("rowwise", None, f"inside {unit.path}, which computes each position from that "
                                                        "position alone (verified on probes): follows the shard")
        for out in unit.outputs:
            self.places[out] = place
            self.infos[out] = SeqInfo("rowwise", place.dim, f"the output of {unit.path}, computed position by "
                                                            "position (verified on probes): follows the shard")

    def unplaced(self, node: fx.Node) -> None:
        """A node reading no sequence: an ``arange`` as long as the sequence produces positions."""
        size = shape(node)
        if is_op(node, "arange") and size == (self.seq_len,):
            self.places[node] = Place(0, self.seq_len, kind="pos")
            self.infos[node] = SeqInfo("positions", 0, "an arange over the sequence: under cp the rank's global "
                                                       "positions (CpLayout.positions)")
        else:
            self.infos[node] = SeqInfo("replicated")

    def positional(self, node: fx.Node) -> None:
        """Operands the rule found spanning the sequence unsharded: a table read at the rank's positions, or
        an input that should have been declared."""
        for arg, place in self.reader.positional:
            inputs = [a for a in ancestors([arg]) if a.op == "placeholder"]
            if inputs:
                self.refuse(node, f"{arg.name} spans the sequence (dim {place.dim}) but comes from input(s) "
                                  f"{[a.name for a in inputs]} that are not declared cut on the sequence",
                            f"declare {inputs[0].name} in seq_inputs with its sequence dim")
                continue
            tables = [a.target for a in ancestors([arg]) if param_of(self.gm, a) is not None or a.op == "get_attr"]
            self.places[arg] = place
            self.infos[arg] = SeqInfo("positional", place.dim, f"a table spanning the sequence ({tables[:2]}): read at "
                                                               "the rank's global positions")
        self.reader.positional.clear()


def analyze_sequence(gm: fx.GraphModule, *, seq_inputs: Mapping[str, int],
                     positions: Collection[str] = ("position_ids",),
                     attention: AttentionReport | None = None) -> SeqReport:
    """Every node's sequence rule and the refusals (``seq_inputs``: ``{input name: its sequence dim}``;
    ``positions``: the inputs among them that hold positions; ``attention``: :func:`find_attention`'s report)."""
    attention = attention if attention is not None else find_attention(gm)
    return _Walk(gm, seq_inputs=seq_inputs, positions=positions, attention=attention).run()


def annotate_sequence(gm: fx.GraphModule, **options) -> SeqReport:
    """:func:`analyze_sequence`, and ``autopar.seq`` written on every node."""
    report = analyze_sequence(gm, **options)
    infos = dict(report.infos)
    for node in gm.graph.nodes:
        set_meta(node, SEQ, infos[node.name])
    return report
