"""The ``autopar`` command: help texts, ``inspect`` output, the Plan as JSON, and its errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

import autopar
from autopar.cli import main, parse_mesh
from autopar.errors import PlanError

GPT = "autopar.models.examples:gpt_tiny"


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["inspect"], ["train"]], ids=["autopar", "inspect", "train"])
def test_help_exits_0_and_shows_an_example(command, capsys):
    text = _help(command, capsys)
    assert "examples:" in text
    assert f"autopar {command[0] if command else 'inspect'} " in text


def _subcommands() -> dict:
    from autopar.cli import build_parser

    return next(a for a in build_parser()._actions if a.dest == "command").choices


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_every_subcommand_says_what_it_does_with_an_example(name, capsys):
    """Every subcommand, including ones added later: a one-line summary in `autopar --help`, a
    description and an example of itself in its own --help."""
    assert f"  {name} " in _help([], capsys)
    parser = _subcommands()[name]
    assert parser.description and len(parser.description) > 40
    text = _help([name], capsys)
    assert "examples:" in text and f"  autopar {name} " in text


def test_python_dash_m_autopar_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "autopar", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "inspect" in done.stdout and "train" in done.stdout


def test_inspect_prints_summary_and_the_rank_graph(capsys):
    assert main(["inspect", GPT, "--mesh", "dp=1,pp=2,tp=2", "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for GPT: dp=1 x pp=2 x tp=2 = 4 ranks")
    assert "# rank 0: dp=0 pp=0 tp=0" in out
    assert "tp_copy" in out and "tp_reduce" in out and "send_" in out
    assert "## schedule for pp rank 0:" in out


def test_inspect_all_ranks_prints_every_rank(capsys):
    assert main(["inspect", "autopar.models.examples:llama_tiny", "--mesh", "dp=2,pp=2",
                 "--schedule", "gpipe", "--all-ranks"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("# rank ")] == [
        "# rank 0: dp=0 pp=0 tp=0", "# rank 1: dp=0 pp=1 tp=0",
        "# rank 2: dp=1 pp=0 tp=0", "# rank 3: dp=1 pp=1 tp=0"]
    assert "recv_" in out and "gpipe" in out


def test_inspect_json_is_a_plan(capsys):
    assert main(["inspect", GPT, "--mesh", "dp=2,pp=2,tp=1", "--microbatches", "2", "--json"]) == 0
    plan = autopar.Plan.model_validate_json(capsys.readouterr().out)
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.tp) == (2, 2, 1)
    assert plan.pipeline.num_microbatches == 2 and plan.global_batch_size == 8


def test_inspect_bare_model_takes_input_shape(capsys):
    assert main(["inspect", "autopar.models.examples:gpt_tiny_model", "--mesh", "pp=2",
                 "--input-shape", "8x32", "--input-dtype", "long"]) == 0
    out = capsys.readouterr().out
    assert "Plan for GPT: dp=1 x pp=2 x tp=1" in out and "send_" in out


def test_inspect_a_cp_mesh_shows_the_attention_nodes_and_the_strategy(capsys):
    """--mesh dp=1,cp=2: the summary names cp and what auto resolved to (the all-to-all: 4 heads divide
    by 2), rank 1's program lists its UlyssesAttention nodes, and the critical path is printed."""
    assert main(["inspect", GPT, "--mesh", "dp=1,cp=2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for GPT: dp=1 x cp=2 x pp=1 x tp=1 = 2 ranks")
    assert "attention by auto: all_to_all x2; gradients summed over dp x cp = 2" in out
    assert "critical path" in out and "# rank 1: dp=0 cp=1 pp=0 tp=0" in out
    assert "cp_attention_0 = self.cp_attention_0(" in out
    assert ("### cp_attention_1 = UlyssesAttention(axis='cp', size=2, seq_len=32, load_balanced=True, causal=True)"
            in out)


def test_inspect_cp_options_reach_the_plan(capsys):
    assert main(["inspect", GPT, "--mesh", "dp=2,cp=2", "--cp-strategy", "ring", "--cp-contiguous", "--json"]) == 0
    plan = autopar.Plan.model_validate_json(capsys.readouterr().out)
    assert (plan.mesh.dp, plan.mesh.cp) == (2, 2) and plan.cp_strategy == "ring" and not plan.cp_load_balanced
    assert [s for _, s in plan.cp_attention] == ["ring", "ring"] and plan.cp_seq_len == 32


def test_cp_options_without_a_cp_axis_exit_2(capsys):
    assert main(["inspect", GPT, "--mesh", "dp=2", "--cp-strategy", "ring"]) == 2
    err = capsys.readouterr().err
    assert "has no cp axis" in err and "Fix: add cp=N" in err and "Traceback" not in err


@pytest.mark.parametrize("mesh,words", [
    ("dp=2,pp=x", "not a positive integer"),
    ("dp=0", "not a positive integer"),
    ("xx=2", "AXIS one of dp, cp, pp, tp"),
    ("dp=2,dp=2", "given twice"),
    ("2,2,1", "AXIS=DEGREE"),
])
def test_bad_mesh_exits_2_with_a_clear_message(mesh, words, capsys):
    assert main(["inspect", GPT, "--mesh", mesh]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("autopar inspect: error: ")
    assert words in captured.err and "Where: --mesh" in captured.err and "Fix:" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("target,words", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("autopar.models.examples:no_such_callable", "has no attribute 'no_such_callable'"),
    ("autopar.models.examples", "not of the form MODULE:CALLABLE"),
    ("autopar.models.examples:gpt_tiny_model", "--input-shape"),
])
def test_bad_target_exits_2(target, words, capsys):
    assert main(["inspect", target, "--mesh", "pp=2"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_rank_outside_the_mesh_exits_2(capsys):
    assert main(["inspect", GPT, "--mesh", "pp=2", "--rank", "2"]) == 2
    assert "rank 2 is outside the mesh" in capsys.readouterr().err


def test_parse_mesh():
    assert (parse_mesh("dp=2, tp=4").dp, parse_mesh("dp=2, tp=4").pp, parse_mesh("dp=2, tp=4").tp) == (2, 1, 4)
    with pytest.raises(PlanError, match="--mesh"):
        parse_mesh("pp=-1")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_inspect_prints_the_critical_path_as_long_as_the_simulated_step(schedule, capsys, monkeypatch):
    """1F1B and ZB-V on pp=4: the line's length is the report's simulated step time, its actions run from
    stage 0's first forward to a last action of a rank."""
    import autopar.models.examples as examples
    from autopar.models import build_model, lm_loss
    from autopar.report.timeline import simulate_plan

    def deep_gpt():
        model = build_model("gpt_tiny", seq_len=32, num_layers=8)
        tokens = examples.lm_batch(vocab_size=model.cfg.vocab_size)[0]
        return model, (tokens,), lm_loss, tokens

    monkeypatch.setattr(examples, "deep_gpt", deep_gpt, raising=False)
    assert main(["inspect", "autopar.models.examples:deep_gpt", "--mesh", "pp=4", "--schedule", schedule,
                 "--microbatches", "8"] + (["--virtual", "2"] if schedule == "zb_v" else [])) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("critical path "))
    model, (tokens,), loss, target = deep_gpt()
    result = autopar.plan(model, (1, 4, 1), example_inputs=(tokens,), loss_fn=loss, example_target=target,
                          schedule=schedule, num_microbatches=8)
    sim = simulate_plan(result).sim
    assert float(line.split()[2]) == pytest.approx(sim.step_time, rel=1e-3)
    assert line.split(": ", 1)[1].split()[0] == "0F0"
    assert f"critical path {sim.critical_path.length:.4g}" in line


def test_plan_prints_the_chosen_pipeline_critical_path(capsys):
    """`autopar plan`: the critical path of the chosen pipeline under the planner's stage times is its
    simulated pipeline time (the step less data-parallel communication, the optimizer and the cluster's fixed
    per-step overhead)."""
    args = ["plan", GPT, "--cluster", "a100-80g-8x", "--world", "2", "--mesh", "pp=2", "--schedule", "zb_h1",
            "--microbatches", "4"]
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("critical path "))
    model, inputs, loss, target = __import__("autopar.models.examples", fromlist=["gpt_tiny"]).gpt_tiny()
    report = autopar.plan(model, {"world": 2, "pp": 2}, example_inputs=inputs, loss_fn=loss, example_target=target,
                          plan="auto", cluster="a100-80g-8x", ranks=[0], schedule="zb_h1", num_microbatches=4).planner
    parts = report.best.parts
    pipeline = report.best.step_time - parts["dp_comm"] - parts["optimizer"] - parts["overhead"]
    assert float(line.split()[2]) == pytest.approx(pipeline, rel=1e-3)
    assert report.critical_path().length == pytest.approx(pipeline, rel=1e-9)


def test_plan_pins_a_cp_mesh_and_shows_its_column(capsys):
    """`autopar plan --mesh dp=1,cp=2` plans on that mesh (cp was dropped from the pins before: the planner then
    chose pp=2); the candidate table has a cp column and the summary the cp line."""
    assert main(["plan", GPT, "--cluster", "cpu-2core", "--world", "2", "--mesh", "dp=1,cp=2"]) == 0
    out = capsys.readouterr().out
    head = next(x for x in out.splitlines() if x.startswith("#"))
    assert head.split()[:5] == ["#", "dp", "cp", "pp", "tp"]
    rows = [x.split() for x in out.splitlines() if x[:1].isdigit() and len(x.split()) > 10]
    assert rows and all(r[1:5] == ["1", "2", "1", "1"] for r in rows)
    assert "cp attention" in head and {r[10] for r in rows} <= {"ring", "all_to_all"}  # the strategy of each row
    assert "chosen: dp=1 cp=2 pp=1 tp=1" in out and "Plan for GPT: dp=1 x cp=2 x pp=1 x tp=1 = 2 ranks" in out
    assert "context parallel: the sequence cut over cp=2" in out
