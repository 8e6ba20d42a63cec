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


@pytest.mark.parametrize("mesh,words", [
    ("dp=2,pp=x", "not a positive integer"),
    ("dp=0", "not a positive integer"),
    ("xx=2", "AXIS one of dp, pp, tp"),
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
