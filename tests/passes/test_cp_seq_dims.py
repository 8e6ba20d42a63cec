"""The sequence analysis (passes/context_parallel/seq_dims.py, seq_rules.py, seq_place.py, rowwise.py).

On every family of tests/cp_families.py (SDPA and eager) and autopar's own models: no refusal, the
rules each family needs (attention, positions and position tables, the causal LM's label shift, the
token loss, MoE layers as row-wise units), and, the semantic check, every dim the analysis calls the
sequence *is* the sequence: in a causal model, changing token s of ``input_ids`` leaves every such node
unchanged at positions before s along that dim and changes it at s or later (the graph run twice).
Hand-written modules cover every refusal and the reductions, scans and shifts cp handles.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")

from autopar.ir.meta_keys import SEQ, get_meta  # noqa: E402
from autopar.passes.frontend.capture import capture  # noqa: E402
from autopar.passes.context_parallel.seq_dims import analyze_sequence, annotate_sequence, default_seq_inputs  # noqa
from cp_families import CAPTURES, SEQ as S, captured  # noqa: E402

CAUSAL_LM = {f for f, _ in CAPTURES} - {"bert"}
MOE = {"mixtral", "deepseek_v3"}
ROTARY = {"llama", "qwen3", "mistral", "gemma2", "falcon_mq", "mixtral", "deepseek_v3"}
FOLLOWS = ("input", "pointwise", "attention", "rowwise", "label_shift", "scan", "positional", "positions")


def _report(family, impl):
    _, graph, _ = captured(family, impl)
    return graph, analyze_sequence(graph.gm, seq_inputs=default_seq_inputs(graph.gm, seq_len=S))


class _Values(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        return out


@pytest.mark.parametrize("family,impl", CAPTURES)
def test_no_refusal_and_each_family_gets_its_rules(family, impl):
    graph, report = _report(family, impl)
    assert report.refusals == ()
    rules = {info.rule for _, info in report.infos}
    assert {"input", "pointwise", "attention", "loss"} <= rules
    assert len([n for n, i in report.infos if i.rule == "attention" and i.dim is not None]) == 2  # two outputs
    assert ("label_shift" in rules) is (family in CAUSAL_LM)  # transformers shifts the labels inside its loss
    assert ("rowwise" in rules) is (family in MOE)
    if family in ROTARY or family == "gpt2":  # rotary tables, GPT-2's learned positions: from an arange
        assert "positions" in rules and "positional" in rules
    if family == "bert":  # its position table's rows, added as they are (no arange in the graph)
        assert "positional" in rules
    values = {n.name: n.meta.get("val") for n in graph.gm.graph.nodes}
    for name, info in report.infos:  # the dim holds the sequence (or the batch x sequence, or a shifted one)
        if info.dim is not None and isinstance(values[name], torch.Tensor):  # a split's pieces: their getitems
            size = values[name].shape[info.dim]
            assert any(size % n == 0 for n in (S - 1, S, S + 1)), (name, info, tuple(values[name].shape))


@pytest.mark.parametrize("family,impl", [c for c in CAPTURES if c[0] in CAUSAL_LM])
def test_every_sequence_dim_is_where_a_token_change_travels_causally(family, impl):
    graph, report = _report(family, impl)
    _, _, data = captured(family, impl)
    changed = dict(data, input_ids=data["input_ids"].clone())
    position = 10
    changed["input_ids"][:, position] = (changed["input_ids"][:, position] + 7) % 100 + 1
    runs = []
    for batch in (data, changed):
        interp = _Values(graph.gm)
        interp.run(*batch.values(), *graph.extra_args)
        runs.append(interp.values)
    checked, fresh = 0, set()
    for n in graph.gm.graph.nodes:  # a fresh buffer and its slices: their values are recorded before copies fill them
        if str(n.target).startswith("aten.new_empty") or (str(n.target).startswith("aten.slice") and n.args[0] in fresh):
            fresh.add(n)
    for name, info in report.infos:
        if info.rule not in FOLLOWS or info.dim is None or name not in runs[0] or name in {f.name for f in fresh}:
            continue
        a, b = runs[0][name], runs[1][name]
        if a.shape[info.dim] != S:  # merged with the batch (a flattened view): its own dim tells nothing here
            continue
        diff = (a - b).abs().float().movedim(info.dim, 0)
        if not bool(diff.any()):
            continue  # labels and positions do not read input_ids
        scale = float(a.abs().max()) or 1.0
        assert float(diff[:position].max()) <= 1e-6 * scale, (name, info)  # before the token: untouched
        assert bool(diff[position:].any()), (name, info)
        checked += 1
    assert checked > 50


def test_annotate_writes_seq_meta_on_every_node():
    _, graph, _ = captured("gpt2", "sdpa")
    report = annotate_sequence(graph.gm, seq_inputs=default_seq_inputs(graph.gm, seq_len=S))
    assert [get_meta(n, SEQ) for n in graph.gm.graph.nodes] == [info for _, info in report.infos]


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "switch", "deepseek", "loop_moe"])
def test_autopar_models_shard_on_the_sequence_without_refusal(name):
    from autopar.models import examples
    from autopar.models.moe import build_moe, moe_loss
    if name.endswith("tiny"):
        model, (x,), loss_fn, y = getattr(examples, name)()
    else:
        torch.manual_seed(0)
        model, loss_fn = build_moe(name), moe_loss
        x = y = torch.randint(0, 64, (2, S))
    gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    report = analyze_sequence(gm, seq_inputs=default_seq_inputs(gm, seq_len=x.shape[1]))
    assert report.refusals == ()
    rules = {i.rule for _, i in report.infos}
    assert ("rowwise" in rules) is (name in ("switch", "deepseek"))  # gathered experts; the loop form is per-op
    assert ("reduce" in rules) is (name in ("switch", "deepseek", "loop_moe"))  # the router statistics' means


# -- hand-written modules: what cp handles and what it refuses ----------------------------------------
class _Seq(nn.Module):
    """An embedding, then ``step`` on (batch, seq, features), then a head: the test bed of one rule."""

    def __init__(self, step):
        super().__init__()
        self.emb, self.head, self.step = nn.Embedding(50, 8), nn.Linear(8, 50), step

    def forward(self, ids):
        return self.head(self.step(self.emb(ids)))


def _analyse(step, loss_fn=None, **seq_inputs):
    ids = torch.randint(0, 50, (2, S))
    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    gm = capture(_Seq(step), (ids,), loss_fn=loss_fn, example_target=ids).gm
    return analyze_sequence(gm, seq_inputs=seq_inputs or {"ids": 1, "target": 1})


@pytest.mark.parametrize("step,words", [
    (lambda h: F.conv1d(h.transpose(1, 2), torch.ones(8, 8, 3), padding=1).transpose(1, 2), "convolves over the "),
    (lambda h: h.sort(dim=1).values, "sorts along the sequence"),
    (lambda h: h[:, -1:].expand_as(h), "keeps positions [23:24:1] of 24"),
    (lambda h: h[:, 3].unsqueeze(1).expand_as(h), "picks position 3 of the sequence"),
    (lambda h: h.softmax(1), "normalises over the sequence outside any recognised attention"),
    (lambda h: h @ (h.transpose(1, 2) @ h), "multiplies two sequence-sharded values"),
    (lambda h: h.view(2, 4, 6, 8).flip(1).reshape(2, S, 8), "cuts the sequence dim across two dims"),
    (lambda h: h.flip(1), "reverses the sequence"),
])
def test_ops_that_mix_positions_are_refused_by_name_with_a_fix(step, words):
    report = _analyse(step)
    assert report.refusals, words
    first = report.refusals[0]
    assert words in first.reason and first.fix and first.node
    assert report.info(first.node).rule == "refused"


def test_pooling_cumsum_and_shifts_are_exact_rules_with_what_cp_does():
    report = _analyse(lambda h: h - h.mean(1, keepdim=True) + h.cumsum(1))
    assert report.refusals == ()
    (mean,), (cumsum,) = report.with_rule("reduce"), report.with_rule("scan")
    assert "all-reduce SUM over cp" in report.info(mean).note and "exclusive scan" in report.info(cumsum).note
    shifted = _analyse(lambda h: h, loss_fn=lambda out, y: F.cross_entropy(out[:, :-1].flatten(0, 1),
                                                                            y[:, 1:].flatten()))
    assert shifted.refusals == () and len(shifted.with_rule("label_shift")) == 2
    notes = [shifted.info(n).note for n in shifted.with_rule("label_shift")]
    assert any("drops the last 1" in n for n in notes) and any("drops the first 1" in n for n in notes)


def test_an_input_spanning_the_sequence_must_be_declared():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)

        def forward(self, ids, extra):
            return self.emb(ids) + extra

    ids = torch.randint(0, 50, (2, S))
    gm = capture(TwoInputs(), (ids, torch.randn(2, S, 8))).gm
    (refusal,) = analyze_sequence(gm, seq_inputs={"ids": 1}).refusals
    assert "comes from input(s) ['extra']" in refusal.reason and "declare extra in seq_inputs" in refusal.fix
    assert analyze_sequence(gm, seq_inputs={"ids": 1, "extra": 1}).refusals == ()


def test_a_module_that_mixes_positions_is_not_taken_for_a_row_wise_unit():
    """A sort over the sequence inside a submodule: the row-wise probe sees other positions move."""
    class Sorter(nn.Module):
        def forward(self, h):
            order = h[..., 0].argsort(dim=1)
            return torch.gather(h, 1, order.unsqueeze(-1).expand_as(h))

    report = _analyse(Sorter())
    assert report.refusals and "sorts along the sequence" in report.refusals[0].reason
    assert report.refusals[0].path == "model.step" and not report.with_rule("rowwise")


def test_sequence_inputs_that_disagree_are_a_plan_error():
    from autopar.errors import PlanError
    _, graph, _ = captured("gpt2", "sdpa")
    with pytest.raises(PlanError, match=r"missing \['position_ids'\].*name graph inputs"):
        analyze_sequence(graph.gm, seq_inputs={"input_ids": 1, "position_ids": 1})
    with pytest.raises(PlanError, match="disagree"):
        analyze_sequence(graph.gm, seq_inputs={"input_ids": 1, "labels": 0})
