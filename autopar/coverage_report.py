"""``autopar.coverage``: how much of a model tensor parallelism shards, and why the rest stays whole.

Plans the model at ``tp`` in this process (:func:`autopar.plan`, no process group) and reports,
for every weight, how it is sharded (a column or row linear of a region, the vocabulary, an
expert's column or row) or the op and the reason it stays replicated, read off the same analyses
the lowering runs (the region finder's, the vocabulary pass's and the expert pass's reasons).
``share`` is the share of the elements of weights with 2 or more dims that end up sharded.

Example::

    >>> import autopar
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> report = autopar.coverage(model, (x,), tp=2, loss_fn=loss_fn, example_target=y)
    >>> round(report.share, 3)
    0.966
    >>> report.weight("blocks.0.mlp.fc.weight").how, report.weight("blocks.0.mlp.fc.weight").dim
    ('column', 0)
    >>> [(w.name, w.op) for w in report.replicated()]
    [('pos_emb.weight', 'aten.embedding')]

``autopar coverage MODULE:CALLABLE --tp N`` prints the same report (:mod:`autopar.coverage_cli`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError, ShardingError
from autopar.ir.graph_names import MODEL_PREFIX
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.passes.tp.tp_coverage import unsharded_matmuls
from autopar.passes.moe.tp_expert import find_expert_regions
from autopar.passes.tp.tp_regions import find_tp_regions
from autopar.passes.tp.tp_rules import op_name
from autopar.passes.tp.vocab_parallel import find_vocab_parallel

__all__ = ["coverage", "coverage_by_tp", "CoverageReport", "WeightCoverage"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightCoverage:
    """One parameter: how it is sharded over tp, or the op reading it and why it stays replicated.

    ``how``: ``column``, ``gathered column`` (its output all-gathered), ``row``, ``vocab``, ``expert column``,
    ``expert row``, ``sharded`` (another sharding pass) or ``replicated``; ``dim``/``chunks``: its ShardLayout when sharded.
    """

    name: str
    shape: tuple[int, ...]
    how: str
    dim: int | None = None
    chunks: int = 1
    op: str = ""
    reason: str = ""

    @property
    def numel(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    @property
    def sharded(self) -> bool:
        return self.how != "replicated"


@dataclass(frozen=True)
class CoverageReport:
    """Every parameter's :class:`WeightCoverage` at ``tp``; ``refused``: the plan's error, if it was refused."""

    model_name: str
    tp: int
    weights: tuple[WeightCoverage, ...]
    refused: str = ""

    @property
    def share(self) -> float:
        """Share of the elements of the weights with 2 or more dims that are sharded."""
        big = [w for w in self.weights if len(w.shape) >= 2]
        total = sum(w.numel for w in big)
        return sum(w.numel for w in big if w.sharded) / total if total else 0.0

    def weight(self, name: str) -> WeightCoverage:
        for w in self.weights:
            if w.name == name:
                return w
        raise PlanError(f"no parameter {name!r} in the coverage report of {self.model_name}",
                        where="CoverageReport.weight", fix="name a parameter as model.named_parameters() does")

    def replicated(self, *, min_dims: int = 2) -> tuple[WeightCoverage, ...]:
        """The weights with at least ``min_dims`` dims that stay replicated."""
        return tuple(w for w in self.weights if not w.sharded and len(w.shape) >= min_dims)

    def table(self, *, min_dims: int = 2) -> str:
        """The report as text: one line per weight with at least ``min_dims`` dims, then the share."""
        lines = [f"{self.model_name} at tp={self.tp}: {self.share:.1%} of the elements of >=2-D weights sharded"]
        if self.refused:
            lines.append(f"plan refused: {self.refused}")
        for w in self.weights:
            if len(w.shape) < min_dims:
                continue
            shape = "x".join(map(str, w.shape))
            if w.sharded:
                how = f"{w.how} (dim {w.dim}" + (f", {w.chunks} blocks)" if w.chunks > 1 else ")")
                lines.append(f"  {w.name}  [{shape}]  {how}")
            else:
                lines.append(f"  {w.name}  [{shape}]  replicated: " + (f"{w.op}: " if w.op else "") + w.reason)
        return "\n".join(lines)


def _user(target: str) -> str:
    prefix = MODEL_PREFIX + "."
    return target[len(prefix):] if target.startswith(prefix) else target


def _params_read(node: fx.Node) -> list[str]:
    """User names of the parameters ``node`` reads, through shape ops on the weight (transpose, view)."""
    out, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            out.append(_user(n.target))
        elif n.op == "call_function" and op_name(n) in ("transpose", "t", "numpy_T", "permute", "view", "reshape",
                                                         "to", "_to_copy", "select", "getitem", "index"):
            stack.extend(a for a in n.all_input_nodes if a.op == "get_attr" or a.all_input_nodes)
    return out


def _op(node: fx.Node) -> str:
    return f"aten.{op_name(node)}" if node.op == "call_function" else node.op


def _reasons(gm: fx.GraphModule, *, tp: int) -> dict[str, tuple[str, str]]:
    """{parameter: (op, reason)} for the candidates the analyses leave replicated, first reason kept."""
    rejected: dict[fx.Node, str] = {}
    vocab = find_vocab_parallel(gm, tp_size=tp, rejected=rejected)
    find_tp_regions(gm, skip=[vocab.head] if vocab.head is not None else [], tp_size=tp, rejected=rejected)
    find_expert_regions(gm, rejected=rejected)
    for node in unsharded_matmuls(gm):
        rejected.setdefault(node, f"aten.{op_name(node)} with a weight operand has no tensor-parallel rule")
    out: dict[str, tuple[str, str]] = {}
    for node, why in rejected.items():
        for name in _params_read(node):
            out.setdefault(name, (_op(node), why))
    for node in gm.graph.nodes:  # whatever no candidate reads: name the op that does
        if node.op != "get_attr":
            continue
        users = [u for u in node.users]
        ops = sorted({_op(u) for u in users})
        where = {get_meta(u, MODULE).path for u in users if get_meta(u, MODULE)}
        out.setdefault(_user(node.target), (", ".join(ops), f"no tensor-parallel candidate reads it "
                                                           f"(module {', '.join(sorted(where)) or '<root>'})"))
    return out


def _kinds(plan) -> dict[str, str]:
    """{module path: column / row / vocab} from the Plan's regions and vocabulary choice."""
    kinds = {}
    for region in plan.tp_regions:
        kinds.update({p: "column" for p in region.columns})
        kinds.update({p: "row" for p in region.rows})
        kinds.update({p: "gathered column" for p in region.gathered})
    kinds.update({p: "vocab" for p in plan.vocab_parallel})
    return kinds


def _how(names: list[str], kinds: dict[str, str], experts: dict[str, str]) -> str:
    """The kind of a sharded parameter read under ``names`` (a tied one under each of its modules')."""
    for name in names:
        if name in experts:
            return experts[name]
        module = name.rpartition(".")[0]
        if module in kinds:
            return kinds[module]
    return "sharded"


def coverage(model: nn.Module, example_inputs, *, tp: int = 2, loss_fn=None, example_target=None,
             **options) -> CoverageReport:
    """Plan ``model`` at tensor-parallel degree ``tp`` and say how each weight is sharded, or why not.

    ``example_inputs``, ``loss_fn``, ``example_target`` and ``options`` are :func:`autopar.plan`'s.
    A plan refused with :class:`ShardingError` (a size tp does not divide) gives a report with
    ``refused`` set and every weight replicated for that reason.
    """
    return coverage_by_tp(model, example_inputs, tps=(tp,), loss_fn=loss_fn, example_target=example_target,
                          **options)[tp]


def coverage_by_tp(model: nn.Module, example_inputs, *, tps=(2, 4), loss_fn=None, example_target=None,
                   planned=None, **options) -> dict[int, CoverageReport]:
    """{tp: :func:`coverage` at tp} for each degree of ``tps``, capturing the model once.

    ``planned``: an :func:`autopar.plan` result of this same model on ``{"tp": tps[0]}`` (the
    caller's, e.g. to read its rewritten graph too); its capture is reused instead of planning again.
    """
    from autopar.lowering import lower_captured
    from autopar.planning import plan as plan_model

    names = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    params = dict(model.named_parameters())
    captured, out = None, {}
    if planned is not None:
        if planned.plan.mesh.tp != tps[0]:
            raise PlanError(f"the planned result is at tp={planned.plan.mesh.tp}, not at tps[0]={tps[0]}",
                            where="coverage_by_tp(planned=...)",
                            fix=f"plan the model on {{'tp': {tps[0]}}}, or drop planned")
        captured = planned.captured
    for tp in tps:
        try:
            if planned is not None and tp == tps[0]:
                plan = planned.plan
            elif captured is None:
                result = plan_model(model, {"tp": tp}, example_inputs=example_inputs, loss_fn=loss_fn,
                                      example_target=example_target, ranks=[0], **options)
                captured, plan = result.captured, result.plan
            else:  # the capture does not depend on tp: lower the same graph at another degree
                mesh = captured.mesh.model_copy(update={"tp": tp})
                again = replace(captured, plan=captured.plan.model_copy(update={"mesh": mesh}))
                plan = lower_captured(again, tp_rank=0).plan
        except ShardingError as exc:
            weights = tuple(WeightCoverage(n, tuple(p.shape), "replicated", reason=f"the plan at tp={tp} was refused")
                            for n, p in params.items())
            out[tp] = CoverageReport(type(model).__name__, tp, weights, refused=str(exc))
            continue
        out[tp] = _report(type(model).__name__, plan, captured.captured.gm, tp=tp, params=params, aliases=aliases)
    return out


def _report(model_name: str, plan, gm: fx.GraphModule, *, tp: int, params: dict, aliases: dict) -> CoverageReport:
    """The report of one Plan, with the reasons read off ``gm`` (the captured graph, before any transform)."""
    reasons = {aliases.get(k, k): v for k, v in _reasons(gm, tp=tp).items()}
    experts = {aliases.get(k, k): v for k, v in _expert_kinds(gm).items()}
    shards = {aliases.get(k, k): v for k, v in plan.param_shards.items()}
    kinds = _kinds(plan)
    weights = []
    for name, p in params.items():
        spec = shards.get(name)
        if spec is not None:
            tied = [name] + [a for a, n in aliases.items() if n == name and a != name]
            weights.append(WeightCoverage(name, tuple(p.shape), _how(tied, kinds, experts),
                                          dim=spec.dim, chunks=spec.chunks))
            continue
        op, why = reasons.get(name, ("", "not read by the captured graph (a repeated block, or unused)"))
        weights.append(WeightCoverage(name, tuple(p.shape), "replicated", op=op, reason=why))
    return CoverageReport(model_name, tp, tuple(weights))


def _expert_kinds(gm: fx.GraphModule) -> dict[str, str]:
    out = {}
    for region in find_expert_regions(gm):
        out.update({name: "expert column" for name in region.column_params()})
        out.update({name: "expert row" for name in region.row_params()})
    return {_user(k): v for k, v in out.items()}
