"""bench/bench_cp_gpu.py, autopar's cp against torch's ``context_parallel`` on GPUs: what runs without one.

The plain cases run on CPU in the default suite: the module imports, its arguments parse, its one-GPU note
says that cp=2 needs 2 GPUs, and the dry run checks torch's ``context_parallel`` has the keyword parameters
the script passes and plans autopar's cp=2 program of a small copy of the benchmark's model. The ``gpu`` case
runs a short measurement on one GPU (cp=1 of both) through the same code as ``bash bench/gpu_check.sh``.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    module = importlib.import_module("bench_cp_gpu")
    yield module
    sys.modules.pop("bench_cp_gpu", None)


def test_arguments_parse_with_the_documented_defaults(bench, capsys):
    args = bench.parse_args([])
    assert (args.seq, args.batch, args.layers, args.strategy) == (bench.SEQ, 1, 8, "ring") and not args.dry_run
    assert bench.parse_args(["--seq", "4096", "--strategy", "all_to_all"]).strategy == "all_to_all"
    for bad in (["--seq", "4095"], ["--strategy", "bogus"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert "error" in capsys.readouterr().err


def test_one_gpu_compares_cp_1_and_says_cp_2_needs_two(bench):
    assert bench.cp_note(1, 1).startswith("cp=1 of both") and "cp=2 needs 2 GPUs" in bench.cp_note(1, 1)
    assert bench.cp_note(2, 2) == "cp=2: 2 ranks, one per GPU"


@pytest.mark.parametrize("strategy,node", [("ring", "RingAttention"), ("all_to_all", "UlyssesAttention")])
def test_dry_run_checks_torchs_api_and_plans_autopars_cp(bench, strategy, node, capsys):
    out = bench.main(["--dry-run", "--strategy", strategy])
    assert set(bench.TORCH_CP_PARAMS) <= set(out["api"]["params"]) and out["api"]["torch"] == torch.__version__
    assert out["rank1_attention"] == [node, node]  # the small copy's two layers, on cp rank 1
    assert "dp=1 x cp=2" in out["summary"] and f"{strategy} x2" in out["summary"]
    assert out["measured_shape"]["seq_len"] == bench.SEQ and out["rotary_tables"] == 4
    printed = capsys.readouterr().out
    assert "context_parallel(" in printed and "would measure" in printed


def test_rotary_tables_are_every_layers_cos_and_sin(bench):
    model = bench._model({**bench.DRY_SHAPE, "seq_len": 16}, "cpu")
    tables = bench.rotary_tables(model)
    assert len(tables) == 2 * bench.DRY_SHAPE["num_layers"] and all(t.shape[0] == 16 for t in tables)
    assert all(any(t is b for b in model.buffers()) for t in tables)  # the buffers themselves: sharded in place


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_measures_nothing_and_says_so(bench, capsys):
    assert bench.main(["--no-doc"]) == []
    assert "no CUDA device here" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_short_run_on_one_gpu_gives_both_contenders_figures(bench):
    rows = bench.main(["--seq", "512", "--layers", "1", "--rounds", "1", "--steps-per-round", "1", "--warmup", "1",
                       "--no-doc"])
    r = rows[0]
    assert r["cp"] == 1 and "cp=2 needs 2 GPUs" in r["note"]  # a world of one inside pytest
    assert r["autopar_s"] > 0 and r["peer_s"] > 0 and r["autopar_step_gib"] > 0 and r["peer_step_gib"] > 0
    first = [float(v) for v in r["loss1"].split(" / ")]
    assert abs(first[0] - first[1]) <= 1e-3 * abs(first[1])  # same weights and tokens: the same first loss (TF32)
