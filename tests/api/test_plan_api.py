"""The Plan as a user sees it: JSON round trip, summary, editing and handing back, validation errors."""
from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.ir.shard_layout import ShardLayout
from autopar.models import build_model, lm_loss
from autopar.options import CompileOptions
from autopar.plan_model import MeshShape, PipelinePlan, Plan

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("gpt_tiny", num_layers=4)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (8, 16), generator=g), torch.randint(0, VOCAB, (8, 16), generator=g)


def _plan(model, batch, mesh, **kwargs):
    x, y = batch
    kwargs.setdefault("vocab_parallel", False)  # Megatron's blocks only: the tied head stays whole
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, **kwargs)


@pytest.fixture(scope="module")
def planned(model, batch):
    return _plan(model, batch, {"pp": 2, "tp": 2})


def _stage_blocks(result) -> list[set[str]]:
    stages = sorted(result.lowered[0].stages, key=lambda s: s.stage)
    return [{n.split(".")[2] for n in s.param_names if n.startswith("model.blocks.")} for s in stages]


def _edited(plan: Plan, **pipeline) -> Plan:
    """A copy of ``plan`` with pipeline fields changed, validated like a hand-edited JSON file."""
    data = json.loads(plan.model_dump_json())
    data["pipeline"].update(pipeline)
    return Plan.model_validate_json(json.dumps(data))


# --- round trip and summary -----------------------------------------------------------------

def test_plan_round_trips_through_json_and_dict(planned):
    plan = planned.plan
    text = plan.model_dump_json()
    assert Plan.model_validate_json(text) == plan
    assert Plan.model_validate(plan.model_dump()) == plan
    data = json.loads(text)
    assert data["mesh"] == {"dp": 1, "pp": 2, "tp": 2} and data["pipeline"]["stage_starts"] == ["blocks.2"]
    assert data["param_shards"]["blocks.0.attn.qkv.weight"] == {"dim": 0, "chunks": 3, "parts": 0, "blocks": []}
    assert data["shared_params"] == {"lm_head.weight": [0, 1]}


def test_plan_records_what_was_decided(planned, model):
    plan = planned.plan
    assert plan.mesh == MeshShape(dp=1, pp=2, tp=2) and plan.mesh.world_size == 4
    assert plan.global_batch_size == 8 and plan.pipeline.num_microbatches == 4 and plan.microbatch_size == 2
    assert plan.num_parameters == sum(p.numel() for p in model.parameters())
    assert len(plan.tp_regions) == 8  # attention and MLP of 4 blocks
    assert plan.tp_regions[0].columns == ("blocks.0.attn.qkv",) and plan.tp_regions[0].rows == ("blocks.0.attn.proj",)
    assert plan.param_shards["blocks.3.mlp.proj.weight"] == ShardLayout(dim=1)


def test_summary_names_mesh_batch_pipeline_tp_zero_and_sharing(planned):
    text = planned.summary()
    assert text == planned.plan.summary()
    lines = text.splitlines()
    assert lines[0] == "Plan for GPT: dp=1 x pp=2 x tp=2 = 4 ranks, " + f"{planned.plan.num_parameters:,} parameters"
    assert "batch 8 = dp 1 x 4 microbatches x 2" in text
    assert "pipeline: 1f1b, 2 stages, stages start at blocks.2" in text
    assert "tensor parallel: 8 regions, 24 sharded parameters" in text
    assert "ZeRO stage 1 over dp" in text and "capture with export" in text
    assert "lm_head.weight on stages [0, 1]" in text
    assert len(lines) <= 8


# --- editing a plan and handing it back -----------------------------------------------------

def test_edited_stage_starts_change_the_split(planned, model, batch):
    assert _stage_blocks(planned) == [{"0", "1"}, {"2", "3"}]
    edited = _edited(planned.plan, stage_starts=["blocks.1"])
    result = _plan(model, batch, None, plan=edited)
    assert result.plan.pipeline.stage_starts == ("blocks.1",)
    assert _stage_blocks(result) == [{"0"}, {"1", "2", "3"}]
    assert result.plan.mesh == planned.plan.mesh  # the mesh comes from the plan


def test_plan_edited_with_model_copy_is_honoured_too(planned, model, batch):
    plan = planned.plan
    edited = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(
        update={"stage_starts": ("blocks.3",), "schedule": "gpipe", "num_microbatches": 2})})
    result = _plan(model, batch, None, plan=edited)
    assert result.plan.pipeline == PipelinePlan(schedule="gpipe", num_microbatches=2, stage_starts=("blocks.3",))
    assert result.schedule.name == "gpipe" and result.plan.microbatch_size == 4
    assert _stage_blocks(result) == [{"0", "1", "2"}, {"3"}]


def test_edited_tp_regions_choose_what_is_sharded(planned, model, batch):
    plan = planned.plan
    attention_only = tuple(r for r in plan.tp_regions if r.columns[0].endswith("attn.qkv"))
    edited = Plan.model_validate({**plan.model_dump(), "tp_regions": [r.model_dump() for r in attention_only]})
    result = _plan(model, batch, None, plan=edited)
    assert result.plan.tp_regions == attention_only
    assert result.plan.param_shards and all(".attn." in k for k in result.plan.param_shards)


# --- validation errors are PlanErrors -------------------------------------------------------

def _assert_plan_error(info, *, what: str, where: str, fix: str):
    err = info.value
    assert type(err) is autopar.PlanError
    assert what in err.what and where in err.where and fix in err.fix, str(err)
    assert str(err).count("Where:") == 1 and "Fix:" in str(err)


@pytest.mark.parametrize("build", [
    lambda: Plan(global_batch_size=8, pipeline=PipelinePlan(schedule="zigzag")),
    lambda: Plan(global_batch_size=8, pipeline={"schedule": "zigzag"}),
    lambda: PipelinePlan(schedule="zigzag"),
    lambda: Plan.model_validate_json('{"global_batch_size": 8, "pipeline": {"schedule": "zigzag"}}'),
    lambda: Plan.model_validate({"global_batch_size": 8, "pipeline": {"schedule": "zigzag"}}),
], ids=["nested-object", "nested-dict", "pipeline", "json", "dict"])
def test_bad_schedule_name_raises_plan_error(build):
    with pytest.raises(autopar.PlanError) as info:
        build()
    _assert_plan_error(info, what="unknown schedule 'zigzag'", where="schedule (got 'zigzag')", fix="1f1b")


@pytest.mark.parametrize("build", [
    lambda: Plan(global_batch_size=8, zero_stage=4),
    lambda: Plan.model_validate_json('{"global_batch_size": 8, "zero_stage": 4}'),
], ids=["construct", "json"])
def test_zero_stage_4_raises_plan_error(build):
    with pytest.raises(autopar.PlanError) as info:
        build()
    _assert_plan_error(info, what="zero_stage", where="Plan.zero_stage (got 4)", fix="less than or equal to 3")


@pytest.mark.parametrize("build", [
    lambda: Plan(global_batch_size=10, mesh=MeshShape(dp=2), pipeline=PipelinePlan(num_microbatches=2)),
    lambda: Plan.model_validate_json(
        '{"global_batch_size": 10, "mesh": {"dp": 2}, "pipeline": {"num_microbatches": 2}}'),
], ids=["construct", "json"])
def test_batch_not_divisible_raises_plan_error(build):
    with pytest.raises(autopar.PlanError) as info:
        build()
    _assert_plan_error(info, what="global batch 10 is not divisible by dp=2 x microbatches=2",
                       where="Plan.global_batch_size", fix="multiple of 4")


def test_wrong_number_of_stage_starts_raises_plan_error(planned):
    with pytest.raises(autopar.PlanError) as info:
        _edited(planned.plan, stage_starts=["blocks.1", "blocks.2"])
    _assert_plan_error(info, what="2 stage starts given for 2 stages", where="stage_starts", fix="exactly 1")


def test_unknown_and_misspelled_fields_raise_plan_error(planned):
    data = json.loads(planned.plan.model_dump_json())
    data["zero_stgae"] = 1
    with pytest.raises(autopar.PlanError) as info:
        Plan.model_validate_json(json.dumps(data))
    _assert_plan_error(info, what="unknown field 'zero_stgae'", where="Plan.zero_stgae", fix="zero_stage")
    with pytest.raises(autopar.PlanError) as info:
        Plan.model_validate_json('{"global_batch_size": 8,')
    _assert_plan_error(info, what="Invalid JSON", where="Plan", fix="model_dump_json")
    with pytest.raises(autopar.PlanError) as info:
        MeshShape(dp=0)
    _assert_plan_error(info, what="dp", where="MeshShape.dp (got 0)", fix="greater than or equal to 1")


@pytest.mark.parametrize("options,what,fix", [
    ({"schedule": "zigzag"}, "unknown schedule 'zigzag'", "interleaved_1f1b"),
    ({"zero_stage": 4}, "zero_stage", "less than or equal to 3"),
    ({"capture": "jit"}, "capture", "'export' or 'symbolic_trace'"),
    ({"num_microbatches": 0}, "num_microbatches", "greater than or equal to 1"),
    ({"shedule": "gpipe"}, "unknown field 'shedule'", "known: schedule"),
])
def test_bad_options_raise_plan_error(options, what, fix):
    with pytest.raises(autopar.PlanError) as info:
        CompileOptions(**options)
    _assert_plan_error(info, what=what, where="CompileOptions." + next(iter(options)), fix=fix)


def test_bad_options_passed_to_plan_raise_plan_error(model, batch):
    with pytest.raises(autopar.PlanError, match="unknown schedule 'zigzag'"):
        _plan(model, batch, {"pp": 2}, schedule="zigzag")


def test_plan_edited_into_an_invalid_state_without_validation_is_still_refused(planned, model, batch):
    # model_copy(update=...) skips pydantic's validation; the Plan built from it is validated
    edited = planned.plan.model_copy(update={"pipeline": planned.plan.pipeline.model_copy(
        update={"schedule": "zigzag"})})
    with pytest.raises(autopar.AutoparError, match="zigzag"):
        _plan(model, batch, None, plan=edited)
