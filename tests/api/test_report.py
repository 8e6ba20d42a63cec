"""The HTML report and the graph diff (autopar.report), read as text; test_report_browser.py renders it."""
from __future__ import annotations

import html
import re
import types

import pytest

import autopar
from autopar.cli import main
from autopar.errors import PlanError
from autopar.models import examples
from autopar.ops.collectives import TpCopy, TpReduce, collective_nodes
from autopar.ops.context_parallel.ring import RingAttention
from autopar.ops.p2p import p2p_nodes
from autopar.report import graph_diff, render_report, timeline_svg, write_report
from autopar.report import memory_view
from autopar.report.collect import graph_groups, original_graph
from autopar.report.timeline import simulate_plan
from autopar.runtime.schedules.gpipe import gpipe
from autopar.runtime.schedules.simulator import StageCosts, simulate

GPT = "autopar.models.examples:gpt_tiny"


@pytest.fixture(scope="module")
def result():
    model, (tokens,), loss_fn, targets = examples.gpt_tiny()
    return autopar.plan(model, {"dp": 2, "pp": 2, "tp": 2}, example_inputs=(tokens,), loss_fn=loss_fn,
                        example_target=targets)


@pytest.fixture(scope="module")
def page(result):
    return render_report(result)


def test_report_holds_the_plan_summary_and_its_json(result, page):
    assert html.escape(result.plan.summary()) in page
    json_text = html.unescape(re.search(r'<pre id="plan-json">(.*?)</pre>', page, flags=re.S).group(1))
    assert autopar.Plan.model_validate_json(json_text) == result.plan


def test_one_section_per_stage_and_tp_rank_listing_its_ranks(result, page):
    sections = re.findall(r'<section class="graph" id="graph-s(\d)-t(\d)"', page)
    assert sections == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    groups = graph_groups(result)
    assert [g.ranks for g in groups] == [(0, 4), (1, 5), (2, 6), (3, 7)]  # dp replicas share a graph
    assert len(re.findall(r'<tr class="rank-row" id="rank-\d+">', page)) == 8


def test_collectives_and_transfers_are_marked_once_per_node(result, page):
    groups = graph_groups(result)
    collectives = sum(len(collective_nodes(g.graph.gm)) for g in groups)
    transfers = sum(len(p2p_nodes(g.graph.gm)) for g in groups)
    assert collectives >= 4 * 2 and transfers == 4  # every block: f and g twice; one send + one recv per tp rank
    assert page.count('<tr class="n k-collective') == page.count('class="badge coll"') == collectives
    assert page.count('class="badge p2p"') == transfers
    assert "TpCopy" in page and "TpReduce" in page and "all_reduce(forward) over tp (2 ranks)" in page


def test_nodes_show_shapes_placements_and_stage_colours(page):
    row = re.search(r'<tr class="n k-compute pl-S"[^>]*><td>linear</td>.*?</tr>', page).group(0)
    assert "(1, 32, 48)" in row and "S(2,chunks=3)" in row and "#1f77b4" in row  # stage 0's colour
    assert '<tr class="n k-compute pl-P"' in page  # a row linear's partial sum


def test_timeline_is_an_inline_svg_of_every_action(result, page):
    svg = re.search(r'<svg class="timeline".*?</svg>', page, flags=re.S).group(0)
    m, stages = result.plan.pipeline.num_microbatches, result.schedule.num_stages
    kinds = re.findall(r'class="ev ev-([FBW])( crit)?"', svg)
    assert sum(k == "F" for k, _ in kinds) == sum(k == "B" for k, _ in kinds) == m * stages
    assert 'data-action="1B3"' in svg
    outlined = re.findall(r'class="ev ev-[FBW] crit" data-action="(\w+)"', svg)  # the critical path, in order
    assert outlined and set(outlined) == set(simulate_plan(result).sim.critical_path.actions)


def test_memory_per_rank_from_the_calculator(page):
    assert len(re.findall(r'<tr class="mem-row">', page)) == 8
    assert "autopar.memory.estimate_memory" in page and "optimizer" in page


def test_memory_falls_back_to_parameter_bytes_and_says_so(result, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("calculator offline")

    monkeypatch.setattr(memory_view, "_from_calculator", broken)
    table = memory_view.rank_memory(result)
    assert "calculator offline" in table.note and "parameter bytes" in table.source
    assert len(table.rows) == 8 and all(parts["params"] > 0 for _r, _c, parts in table.rows)
    assert "could not answer" in memory_view.memory_html(table)


def test_report_is_self_contained(page):
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "@import" not in page and "url(" not in page


def test_write_report(result, tmp_path):
    path = write_report(result, tmp_path / "report.html", title="my report")
    assert path.read_text().startswith("<!DOCTYPE html>") and "<title>my report</title>" in path.read_text()


def test_timeline_svg_of_gpipe_counts_its_bars():
    sim = simulate(gpipe(num_ranks=3, num_microbatches=4), costs=StageCosts(forward=1, backward=1, weight=1))
    svg = timeline_svg(sim, title="gpipe")
    assert svg.count('class="ev ev-F"') == svg.count('class="ev ev-B"') == 12 and "ev-W" not in svg
    assert svg.count(">pp rank ") == 3


# -- the diff ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diff_rank1(result):
    return graph_diff(result, 1)  # dp=0 pp=0 tp=1: stage 0, tensor-parallel rank 1


def test_diff_marks_inserted_collectives_and_sends(result, diff_rank1):
    gm = result.graph(1)
    for node in collective_nodes(gm, TpCopy) + collective_nodes(gm, TpReduce) + p2p_nodes(gm):
        assert re.search(rf"^\+ {node.name} = \w+\(", diff_rank1, flags=re.M), node.name
    assert "+ send_0 = SendActivation(add_2)" in diff_rank1 and "[send to stage 1 (edge 0)]" in diff_rank1


def test_diff_shows_shard_shapes_and_view_sizes(diff_rank1):
    assert re.search(r"^~ model_blocks_0_attn_qkv_weight = param .*\n\s+shape \(96, 32\) -> \(48, 32\)"
                     r"\s+placement S\(0,chunks=3\)$",
                     diff_rank1, flags=re.M)
    assert re.search(r"^~ view = aten.view\(getitem, \[1, 32, 4, 8\]\)\n\s+now aten.view\(getitem, \[1, 32, 2, 8\]\)",
                     diff_rank1, flags=re.M)


def test_diff_lists_replaced_nodes_and_summarises_other_stages(diff_rank1):
    assert re.search(r"^- linear_1 = aten.linear\(view_3, ", diff_rank1, flags=re.M)  # the row linear, re-made
    assert "nodes on other stages (not listed one by one):" in diff_rank1
    assert re.search(r"^  stage 1 \(pp rank 1\): \d+ nodes of blocks.1 \(\d+\)", diff_rank1, flags=re.M)
    assert "linear_4" not in diff_rank1  # stage 1's nodes are counted, not listed


def test_diff_of_the_last_stage_shows_the_vocabulary_parallel_loss(result):
    text = graph_diff(result, 3)  # dp=0 pp=1 tp=1
    assert text.startswith("rank 3 (dp=0 pp=1 tp=1) against the captured graph")
    assert "+ recv_0 = RecvActivation()" in text and "+ vocab_cross_entropy = VocabParallelCrossEntropy(" in text
    assert re.search(r"^- cross_entropy_loss = ", text, flags=re.M)


def test_diff_of_a_stage_the_rank_does_not_run(result):
    with pytest.raises(PlanError, match="rank 1 does not run stage 1"):
        graph_diff(result, 1, stage=1)


# -- the command line ----------------------------------------------------------------------------
def test_inspect_writes_the_report_and_prints_the_diff(tmp_path, capsys):
    path = tmp_path / "r.html"
    assert main(["inspect", GPT, "--mesh", "pp=2", "--html", str(path), "--diff", "--rank", "1"]) == 0
    captured = capsys.readouterr()
    assert f"wrote the report to {path}" in captured.err
    assert path.read_text().count('<section class="graph"') == 2
    out = captured.out
    assert out.startswith("rank 1 (dp=0 pp=1 tp=0) against the captured graph")
    assert re.search(r"^  ··· \d+ unchanged nodes$", out, flags=re.M)  # no tensor parallelism: little changes
    assert "+ recv_0 = RecvActivation()" in out and "now aten.layer_norm(recv_0," in out


def test_inspect_html_prints_only_the_summary(tmp_path, capsys, monkeypatch):
    import autopar.report

    monkeypatch.setattr(autopar.report, "write_report", lambda result, path: path)  # the plan is what is tested
    assert main(["inspect", "autopar.models.examples:mlp_tiny_model", "--mesh", "pp=2", "--input-shape", "8x16",
                 "--input-dtype", "float", "--html", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for MLP") and "def forward" not in out


def test_report_to_a_missing_folder_exits_2(tmp_path, capsys):
    path = tmp_path / "no_such_folder" / "r.html"
    assert main(["inspect", "autopar.models.examples:mlp_tiny_model", "--mesh", "pp=2", "--input-shape", "8x16",
                 "--input-dtype", "float", "--html", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot write the report to" in err and "Where: write_report(path)" in err and "Fix:" in err


def test_a_result_without_its_captured_graph_is_refused():
    with pytest.raises(PlanError, match="holds no captured graph"):
        original_graph(types.SimpleNamespace(captured=None))


@pytest.fixture(scope="module")
def moe_page():
    import torch

    from autopar.models.moe import build_moe, moe_loss

    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 16))
    result = autopar.plan(build_moe("switch"), {"dp": 2}, example_inputs=(idx,), loss_fn=moe_loss,
                          example_target=idx, expert_parallel=2, num_microbatches=1, moe_capacity_factor=1.5)
    return result, render_report(result)


def _cells(row: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_expert_placement_table_gives_each_ranks_experts_and_groups(moe_page, page):
    result, moe = moe_page
    section = re.search(r'<section id="experts">.*?</section>', moe, flags=re.S).group(0)
    head = re.findall(r"<th>(.*?)</th>", section.split("</tr>")[0])
    assert head[-2:] == ["blocks.0.moe", "blocks.1.moe"]  # one column per MoE layer
    rows = [_cells(r) for r in re.findall(r'<tr class="expert-row" id="experts-rank-\d">(.*?)</tr>', section)]
    # rank, dp, pp, tp, ep rank, ep group, edp group, then the experts of each layer (4 experts over ep=2)
    assert rows == [["rank 0", "0", "0", "0", "0", "0, 1", "0", "0\u20131", "0\u20131"],
                    ["rank 1", "1", "0", "0", "1", "0, 1", "1", "2\u20133", "2\u20133"]]
    assert '<a href="#experts">Experts</a>' in moe
    assert 'id="experts"' not in page and "#experts" not in page  # without expert parallelism: no section


def test_token_movement_lists_each_layers_all_to_all_nodes_on_each_rank(moe_page):
    from autopar.ops.moe_ops import moe_exchange_nodes

    result, page = moe_page
    graph = graph_groups(result)[0].graph.gm
    names = [n.name for n in moe_exchange_nodes(graph)]
    assert names == ["moe_dispatch_0", "moe_combine_0", "moe_dispatch_1", "moe_combine_1"]
    rows = [_cells(r) for r in re.findall(r'<tr class="exchange-row">(.*?)</tr>', page, flags=re.S)]
    assert [(r[0], r[1], r[3]) for r in rows] == [
        (f"blocks.{i}.moe", f"rank {k}", f"moe_dispatch_{i} moe_combine_{i}") for i in (0, 1) for k in (0, 1)]
    # the group each all-to-all runs over; the capacity: ceil(1.5 * 64 rows / 4 experts) of a rank's
    # 4 samples x 16 tokens x top-1 rows
    assert {r[4] for r in rows} == {"all_to_all over ep: ranks 0, 1"}
    assert {r[5] for r in rows} == {"capacity factor 1.5: at most 24 of its 64 rows to each expert"}


# -- context parallelism ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cp_result():
    model, (tokens,), loss_fn, targets = examples.gpt_tiny()
    return autopar.plan(model, {"cp": 2, "pp": 2}, example_inputs=(tokens,), loss_fn=loss_fn,
                        example_target=targets, cp_strategy="ring")


@pytest.fixture(scope="module")
def cp_page(cp_result):
    return render_report(cp_result)


def test_cp_report_has_a_graph_per_cp_rank_each_with_its_ring_attention(cp_result, cp_page):
    """cp ranks of one replica run different graphs (their own positions): one section per (stage, tp, cp),
    each holding its stage's RingAttention node; the ranks table has a cp column and links each rank."""
    sections = re.findall(r'<section class="graph" id="graph-s(\d)-t(\d)-c(\d)"', cp_page)
    assert sections == [("0", "0", "0"), ("0", "0", "1"), ("1", "0", "0"), ("1", "0", "1")]
    groups = graph_groups(cp_result)
    assert [g.ranks for g in groups] == [(0,), (2,), (1,), (3,)]  # rank = (cp * pp_size + pp) at dp=1, tp=1
    assert [sum(isinstance(m, RingAttention) for m in g.graph.gm.modules()) for g in groups] == [1, 1, 1, 1]
    assert cp_page.count("(RingAttention &#215;1)") == 4 and cp_page.count('class="badge coll"') == 4
    assert "<th>dp</th><th>cp</th><th>pp</th><th>tp</th>" in cp_page
    rows = dict(re.findall(r'<tr class="rank-row" id="rank-(\d)">(.*?)</tr>', cp_page))
    assert "<td>0</td><td>1</td><td>1</td><td>0</td>" in rows["3"] and 'href="#graph-s1-t0-c1"' in rows["3"]


def test_cp_report_shows_the_plan_with_cp_and_the_strategy_taken(cp_result, cp_page):
    summary = cp_result.plan.summary()
    assert "dp=1 x cp=2 x pp=2 x tp=1 = 4 ranks" in summary
    assert "context parallel: the sequence cut over cp=2 (load-balanced), attention by ring: ring x2" in summary
    assert html.escape(summary) in cp_page
    assert cp_result.plan.cp_attention == (("model.blocks.0.attn", "ring"), ("model.blocks.1.attn", "ring"))
    json_text = html.unescape(re.search(r'<pre id="plan-json">(.*?)</pre>', cp_page, flags=re.S).group(1))
    assert autopar.Plan.model_validate_json(json_text) == cp_result.plan


def test_cp_report_renders_the_timeline_critical_path_and_memory(cp_result, cp_page):
    svg = re.search(r'<svg class="timeline".*?</svg>', cp_page, flags=re.S).group(0)
    m, stages = cp_result.plan.pipeline.num_microbatches, cp_result.schedule.num_stages
    kinds = re.findall(r'class="ev ev-([FBW])( crit)?"', svg)
    assert sum(k == "F" for k, _ in kinds) == sum(k == "B" for k, _ in kinds) == m * stages
    outlined = re.findall(r'class="ev ev-[FBW] crit" data-action="(\w+)"', svg)
    assert outlined and set(outlined) == set(simulate_plan(cp_result).sim.critical_path.actions)
    assert len(re.findall(r'<tr class="mem-row">', cp_page)) == 4 and "autopar.memory.estimate_memory" in cp_page


def test_cp_diff_reads_the_ranks_own_graph(cp_result):
    """cp rank 1 of a 32-token sequence in 4 chunks of 8 holds positions 8..16 and 16..24 (load-balanced)."""
    diff = graph_diff(cp_result, 2)  # dp=0 cp=1 pp=0 tp=0
    assert diff.startswith("rank 2 (dp=0 cp=1 pp=0 tp=0) against the captured graph")
    assert "1 collectives (RingAttention x1)" in diff
    assert "+ arange_start = aten.arange(8, 16" in diff and "+ arange_start_1 = aten.arange(16, 24" in diff
    assert "aten.arange(0, 8" in graph_diff(cp_result, 0)
