"""Options resolve into the Plan in one function, and the lowering reads the Plan, not the options.

Adding an option the Plan records is one field, one line of ``resolve_plan`` and one row of
``RESOLVED`` below; the coverage test fails until the row is there.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
from types import SimpleNamespace

import pytest
import torch

from autopar.lowering import capture_and_annotate, lower_captured
from autopar.models import build_model, lm_loss
from autopar.options import ANALYSIS_OPTIONS, RUNTIME_OPTIONS, CompileOptions, resolve_plan
from autopar.plan_model import MeshShape, Plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = MeshShape(dp=2, pp=2, tp=2)

# option -> (a value other than the default, other options it needs, the Plan's field read back)
RESOLVED = {
    "schedule": ("zb_h1", {}, lambda p: p.pipeline.schedule),
    "num_microbatches": (8, {}, lambda p: p.pipeline.num_microbatches),
    "num_virtual": (3, {"schedule": "looped_bfs"}, lambda p: p.pipeline.num_virtual),
    "zero_stage": (3, {}, lambda p: p.zero_stage),
    "data_parallel": ("dataparallel", {}, lambda p: p.data_parallel),
    "bucket_mb": (5.0, {}, lambda p: p.bucket_mb),
    "capture": ("symbolic_trace", {}, lambda p: p.capture),
    "sequence_parallel": (True, {}, lambda p: p.sequence_parallel),
    "recompute": ("full", {}, lambda p: p.recompute[:1] and p.recompute[0]),
    "precision": ("bf16", {}, lambda p: p.precision),
    "expert_parallel": (2, {}, lambda p: p.expert_parallel),
    "moe_capacity_factor": (1.5, {"expert_parallel": 2}, lambda p: p.moe_capacity_factor),
    "dynamic_shapes": ("seq", {}, lambda p: p.dynamic_shapes),
    "max_seq_len": (48, {}, lambda p: p.max_seq_len),
    "cp_strategy": ("ring", {}, lambda p: p.cp_strategy),
    "cp_load_balanced": (False, {}, lambda p: p.cp_load_balanced),
}


# run option -> a value other than the default: carried by the Plan as plan.run, always the call's
RUN = {"p2p_timeout_s": 9.0, "flight_record": 0, "run_dir": "/tmp/autopar-run", "max_grad_norm": 1.5,
       "optimizer_params": "named", "pipemare_lr_warmup_updates": 7, "pipemare_correction_decay": 0.25,
       "shape_cache_size": 3}


def _resolve(given=None, **options) -> Plan:
    return resolve_plan(CompileOptions(**options), given=given, mesh=MESH, batch=32, model_name="m", num_parameters=7)


def test_every_option_is_resolved_into_the_plan_or_declared_outside_it():
    assert set(RESOLVED) | set(ANALYSIS_OPTIONS) | set(RUNTIME_OPTIONS) == set(CompileOptions.model_fields)
    assert not set(RESOLVED) & (set(ANALYSIS_OPTIONS) | set(RUNTIME_OPTIONS))


@pytest.mark.parametrize("option", sorted(RESOLVED))
def test_each_plan_option_has_its_resolution_line(option):
    value, needs, read = RESOLVED[option]
    assert read(_resolve(**needs, **{option: value})) == value
    assert read(_resolve(**needs)) != value  # (the default resolves to something else)


def test_every_run_option_rides_on_the_plan_as_the_call_gives_it():
    """The runtime reads plan.run, so an option of the run reaches it through the Plan, a given Plan's replaced."""
    assert set(RUN) == set(RUNTIME_OPTIONS)
    given = _resolve()
    for option, value in RUN.items():
        assert getattr(_resolve(**{option: value}).run, option) == value
        assert getattr(_resolve(given, **{option: value}).run, option) == value
        assert getattr(given.run, option) != value


def test_the_dataparallel_baseline_resolves_to_one_pass_without_zero():
    plan = _resolve(data_parallel="dataparallel", schedule="zb_h1", num_microbatches=8, zero_stage=2)
    assert (plan.pipeline.schedule, plan.pipeline.num_microbatches, plan.pipeline.num_virtual) == ("gpipe", 1, 1)
    assert plan.zero_stage == 0 and plan.data_parallel == "dataparallel"


def test_the_defaults_resolve_to_autopars_own_choices():
    plan = _resolve()
    assert (plan.pipeline.schedule, plan.pipeline.num_virtual, plan.pipeline.num_microbatches) == ("1f1b", 1, 4)
    assert _resolve(schedule="zb_v").pipeline.num_virtual == 2  # the registry's stages per rank
    assert _resolve(recompute="selective").recompute == ("selective",) * 2  # one mode per stage
    assert not _resolve(sequence_parallel=True, tensor_parallel=False).sequence_parallel


def test_the_bucket_size_is_an_eighth_of_a_ranks_gradients_within_torchs_cap():
    mb = 2**20 // 4  # parameters per MB of fp32 gradients
    size = lambda n, mesh=MESH: resolve_plan(CompileOptions(), given=None, mesh=mesh, batch=32, model_name="m",
                                              num_parameters=n).bucket_mb
    assert size(96 * mb) == 3.0  # 96 MB over pp x tp = 4: 24 MB a rank, 8 buckets
    assert size(96 * mb, MeshShape(dp=2)) == 12.0
    assert size(10_000 * mb) == 25.0 and size(8 * mb) == 1.0 and size(0) == 1.0


def test_a_given_plan_wins_over_the_options():
    given = _resolve(schedule="gpipe", zero_stage=0, precision="bf16", recompute="full", bucket_mb=3.0)
    plan = _resolve(given, schedule="zb_h1", zero_stage=2, precision="fp32", recompute="none", bucket_mb=9.0)
    assert plan == given
    assert _resolve(_resolve(), recompute="full").recompute == ("full", "full")  # a Plan without modes takes the option's


def _option_reads(path: pathlib.Path) -> set[str]:
    """Attributes read off anything named ``options`` or ``opts`` (``cap.options.x`` included)."""
    def named(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("options", "opts")
                or isinstance(node, ast.Attribute) and node.attr == "options")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and named(n.value)}


def test_the_lowering_reads_no_option_the_plan_records():
    sources = [ROOT / "autopar" / "lowering.py", *(ROOT / "passes").rglob("*.py")]
    reads = set().union(*(_option_reads(p) for p in sources))
    assert reads and reads <= set(ANALYSIS_OPTIONS), reads  # the lowering's passes: the analysis options only
    for name in ("compile.py", "planning.py"):  # the entry points hand runtime options on, nothing the Plan holds
        assert not _option_reads(ROOT / "autopar" / name) & set(RESOLVED), name


def test_lowering_runs_on_the_plan_with_only_the_analysis_options():
    torch.manual_seed(0)
    x = torch.randint(0, 128, (8, 8))
    cap = capture_and_annotate(build_model("gpt_tiny", num_layers=4), mesh=MeshShape(pp=2, tp=2), example_inputs=(x,),
                               example_target=x, loss_fn=lm_loss,
                               options=CompileOptions(capture="symbolic_trace", recompute="full", zero_stage=0))
    full = lower_captured(cap, tp_rank=1)
    analysis_only = SimpleNamespace(**{k: getattr(cap.options, k) for k in ANALYSIS_OPTIONS})
    bare = lower_captured(dataclasses.replace(cap, options=analysis_only), tp_rank=1)
    assert bare.plan == full.plan and bare.plan.recompute == ("full", "full")
    assert [s.gm.code for s in bare.stages] == [s.gm.code for s in full.stages]
