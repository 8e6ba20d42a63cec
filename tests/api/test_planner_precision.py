"""Precision said out loud: a GPU plan kept in fp32 says so, with what bf16 would change; CPUs and bf16 plans
do not. The bf16 figures derived from the fp32 profile are held to a profile captured in bf16, and the
largest batch that fits to the memory calculator's own answer one sample on either side of it."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss
from autopar.options import CompileOptions
from autopar.planner import CostModel, get_cluster, profile_model
from autopar.planner.precision import in_bf16, largest_batch, precision_note, wants_bf16
from autopar.planner.candidates import SearchSpace
from autopar.planner.search import search


def _model_and_tokens(batch: int = 32):
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=4, seq_len=64, hidden=128, num_heads=4)
    return model, torch.randint(0, 128, (batch, 64))


@pytest.fixture(scope="module")
def profiles():
    model, tokens = _model_and_tokens()
    return {p: profile_model(model, example_inputs=(tokens,), loss_fn=lm_loss, example_target=tokens,
                             tp_degrees=(1, 2), options=CompileOptions(precision=p)) for p in ("fp32", "bf16")}


def test_an_fp32_plan_on_gpus_says_so_with_what_bf16_would_change():
    model, tokens = _model_and_tokens()
    report = autopar.plan(model, 8, plan="auto", cluster=get_cluster("a100-80g-8x", world=8), example_inputs=(tokens,),
                          loss_fn=lm_loss, example_target=tokens, ranks=[0]).planner
    (line,) = [r for r in report.reasons if r.startswith("precision: fp32")]
    assert line in report.summary()
    assert "A100-SXM4-80GB" in line and "bf16 16x faster" in line and "precision='bf16'" in line
    fast, slow = (float(x) for x in re.search(r"take about ([0-9.e-]+) s/step instead of ([0-9.e-]+)", line).groups())
    assert fast < slow and f"{report.best.step_time:.4g}" == f"{slow:.4g}"
    b16, b32 = (int(x) for x in re.search(r"up to (\d+) in bf16, (\d+) in fp32", line).groups())
    assert b16 > b32 > 0
    assert "the best bf16 plan, dp=" in line


def test_no_note_on_a_cpu_cluster_or_for_a_bf16_plan(profiles):
    gpu, cpu = get_cluster("a100-80g-8x", world=8), get_cluster("cpu-2core", world=8)
    assert wants_bf16(gpu) and not wants_bf16(cpu)
    space = SearchSpace()
    assert precision_note(search(profiles["fp32"], gpu, world=8), space=space)  # the case that says it
    assert precision_note(search(profiles["fp32"], cpu, world=8), space=space) == []
    assert precision_note(search(profiles["bf16"], gpu, world=8), space=space) == []


def test_bf16_figures_from_the_fp32_profile_match_a_bf16_capture(profiles):
    derived, captured = in_bf16(profiles["fp32"]), profiles["bf16"]
    cluster = get_cluster("a100-80g-8x", world=8)
    result = search(captured, cluster, world=8)
    for e in result.ranked[:5]:
        c = e.candidate
        mine = CostModel(derived, cluster).estimate(c, simulate_pipeline=True)
        theirs = CostModel(captured, cluster).estimate(c, simulate_pipeline=True)
        assert mine.step_time == pytest.approx(theirs.step_time, rel=0.05), c.label()
        assert mine.memory == pytest.approx(theirs.memory, rel=0.10), c.label()


def test_largest_batch_is_the_last_that_fits(profiles):
    profile = profiles["fp32"]
    cluster = get_cluster("a100-80g-8x", world=8)
    cluster = cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_gb": 0.5})})
    c = search(profile, cluster, world=8).best.candidate
    model = CostModel(profile, cluster)
    batch = largest_batch(model, c)
    unit = c.dp * c.num_microbatches
    assert batch % unit == 0 and batch >= profile.global_batch

    def fits(b):  # the memory calculator's own answer at that batch
        return CostModel(replace(profile, global_batch=b), cluster).estimate(c).fits

    assert fits(batch) and not fits(batch + unit)
