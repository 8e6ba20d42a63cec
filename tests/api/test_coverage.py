"""autopar.coverage and ``autopar coverage``: per weight how tp shards it or why not, and the share;
bench/coverage_families.py regenerates docs/coverage.md's table from it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar.cli import main
from autopar.models.examples import gpt_tiny

GPT = "autopar.models.examples:gpt_tiny"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_report():
    model, (x,), loss_fn, y = gpt_tiny()
    return autopar.coverage(model, (x,), tp=2, loss_fn=loss_fn, example_target=y)


def test_each_weight_says_how_it_is_sharded(gpt_report):
    qkv = gpt_report.weight("blocks.0.attn.qkv.weight")
    assert (qkv.how, qkv.dim, qkv.chunks) == ("column", 0, 3)
    assert (gpt_report.weight("blocks.1.mlp.proj.weight").how, gpt_report.weight("blocks.1.mlp.proj.weight").dim) \
        == ("row", 1)
    assert gpt_report.weight("tok_emb.weight").how == "vocab"
    [pos] = gpt_report.replicated()
    assert pos.name == "pos_emb.weight" and pos.op == "aten.embedding" and "position or type table" in pos.reason
    assert gpt_report.share == pytest.approx(1 - pos.numel / sum(w.numel for w in gpt_report.weights
                                                                  if len(w.shape) >= 2))
    assert "96.6%" in gpt_report.table() and "pos_emb.weight" in gpt_report.table()


def test_a_refused_plan_reports_its_error_and_nothing_sharded():
    model, (x,), loss_fn, y = gpt_tiny()
    report = autopar.coverage(model, (x,), tp=3, loss_fn=loss_fn, example_target=y)
    assert "not divisible by tp=3" in report.refused and report.share == 0.0
    assert all(w.how == "replicated" for w in report.weights)


def test_reasons_come_from_the_region_finder():
    """A linear whose shard meets an op with no rule is a gathered column (passes/tp/tp_gather_output.py); one whose
    output the graph returns stays replicated, the reason naming why (find_tp_regions' record)."""
    import torch
    import torch.nn as nn

    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(self.norm(self.up(x)))

    report = autopar.coverage(Normed(), (torch.randn(4, 8),), tp=2)
    up, down = report.weight("up.weight"), report.weight("down.weight")
    assert (up.how, up.dim) == ("gathered column", 0)
    assert down.how == "replicated" and down.op == "aten.linear" and "reaches the graph output" in down.reason
    assert report.share == 0.5


def test_a_weight_read_through_x_dot_T_gets_its_candidates_reason():
    """``x @ W.T`` (Falcon's FalconLinear: ``numpy_T`` then ``matmul``): a rejected candidate's reason is
    reported for W, not the transpose's "no candidate reads it"."""
    import torch
    import torch.nn as nn

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Parameter(torch.randn(16, 8))

        def forward(self, x):  # a column whose shard would reach the graph output: refused, with that reason
            return x @ self.up.T

    report = autopar.coverage(Transposed(), (torch.randn(4, 8),), tp=2)
    up = report.weight("up")
    assert up.how == "replicated" and up.op == "aten.matmul" and "reaches the graph output" in up.reason, up
    assert report.share == 0.0


def test_cli_prints_the_report_and_json(capsys):
    assert main(["coverage", GPT, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT at tp=2: 96.6%") and "blocks.0.attn.qkv.weight  [96x32]  column (dim 0, 3 blocks)" in out
    assert main(["coverage", GPT, "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp"] == 2 and data["share"] == pytest.approx(0.9655, abs=1e-4)
    assert {w["name"] for w in data["weights"]} >= {"pos_emb.weight", "blocks.0.mlp.fc.weight"}


def test_cli_refuses_a_bad_target(capsys):
    assert main(["coverage", "autopar.models.examples:no_such_model", "--tp", "2"]) == 2
    assert "has no attribute" in capsys.readouterr().err


def test_doc_generator_runs_on_one_family(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import coverage_families as gen

    row = gen.family_row("bert")
    assert row.shares[2] >= 0.95 and row.shares[4] >= 0.95 and not row.refused
    assert any("position_embeddings.weight" in r and "position or type table" in r for r in row.replicated)
    assert not any("transform.dense" in r for r in row.replicated)  # a gathered column now
    table = gen.markdown([row])
    assert "| BERT" in table and f"{row.shares[2]:.1%}" in table
    doc = tmp_path / "coverage.md"
    doc.write_text(f"intro\n\n{gen.BEGIN}\nold table\n{gen.END}\n\noutro\n")
    gen.write_doc(table, doc)
    text = doc.read_text()
    assert "old table" not in text and text.startswith("intro") and text.rstrip().endswith("outro")
    assert "| BERT" in text


def test_docs_table_is_the_generators_for_every_family():
    """docs/coverage.md holds one generated row per family of HF_RAW (regenerate: bench/coverage_families.py)."""
    pytest.importorskip("transformers")
    from autopar.models.hf import HF_RAW
    text = (ROOT / "docs" / "coverage.md").read_text()
    table = text[text.index("<!-- tp-coverage:begin -->"):text.index("<!-- tp-coverage:end -->")]
    missing = [name for name in HF_RAW if f"`{name}`)" not in table]
    assert not missing, f"docs/coverage.md lacks rows for {missing}: run python bench/coverage_families.py"
