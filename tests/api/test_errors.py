"""Every bad input raises autopar's own error type, and its message says what, where and what to do."""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.mesh import mesh_info
from autopar.models import build_model, lm_loss

VOCAB = 128


def _batch(size: int = 8, seq: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (size, seq), generator=g), torch.randint(0, VOCAB, (size, seq), generator=g)


def _plan(model, mesh, *, batch: int = 8, **options):
    x, y = _batch(batch)
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, **options)


def _check(info, kind: type, *, what: str, where: str, fix: str):
    """The error is exactly ``kind`` and each part of the message holds the expected words."""
    err = info.value
    assert type(err) is kind, type(err)
    assert err.what and err.where and err.fix, f"message lacks a part: {err}"
    assert what in err.what, err.what
    assert where in err.where, err.where
    assert fix in err.fix, err.fix
    text = str(err)
    assert text.startswith(err.what.rstrip(".")) and "Where: " in text and "Fix: " in text


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return build_model("gpt_tiny")


# --- the mesh -------------------------------------------------------------------------------

def test_mesh_larger_than_the_world_is_a_plan_error(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(autopar.PlanError) as info:
        autopar.init_mesh(dp=2)
    _check(info, autopar.PlanError, what="needs 2 ranks but the world has 1", where="init_mesh",
           fix="torchrun --nproc-per-node 2")
    assert not dist.is_initialized()  # refused before any process group was made


def test_zero_mesh_degree_is_a_plan_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(autopar.PlanError) as info:
        autopar.init_mesh(tp=0)
    _check(info, autopar.PlanError, what="tp", where="MeshShape.tp (got 0)", fix="greater than or equal to 1")


def test_unknown_mesh_dim_name_in_plan_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"xx": 2})
    _check(info, autopar.PlanError, what="unknown mesh dim names ['xx']", where="mesh_shape", fix="'dp', 'cp', 'pp', 'tp'")


def test_unreadable_mesh_shape_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, (2, 2))
    _check(info, autopar.PlanError, what="cannot read mesh shape (2, 2)", where="mesh_shape", fix="(dp, pp, tp)")


@pytest.fixture
def one_rank_group(tmp_path):
    """A real one-rank gloo process group in this process (a FileStore, no network), destroyed after."""
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_device_mesh_with_an_unknown_dim_name_is_a_plan_error(one_rank_group, gpt):
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("xx",))
    with pytest.raises(autopar.PlanError) as info:
        mesh_info(mesh)
    _check(info, autopar.PlanError, what="mesh dim names ['xx'] include unknown ['xx']",
           where="DeviceMesh passed to compile", fix="autopar.init_mesh()")
    x, y = _batch()
    with pytest.raises(autopar.PlanError, match="include unknown"):
        autopar.compile(gpt, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y)


def test_device_mesh_without_dim_names_is_a_plan_error(one_rank_group):
    with pytest.raises(autopar.PlanError) as info:
        mesh_info(init_device_mesh("cpu", (1,)))
    _check(info, autopar.PlanError, what="no mesh_dim_names", where="DeviceMesh", fix="mesh_dim_names")


def test_compile_needs_a_device_mesh(gpt):
    x, y = _batch()
    with pytest.raises(autopar.PlanError) as info:
        autopar.compile(gpt, {"dp": 1}, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    _check(info, autopar.PlanError, what="must be a torch DeviceMesh", where="compile(mesh=...)",
           fix="autopar.init_mesh")


# --- the model against the mesh -------------------------------------------------------------

def test_heads_not_divisible_by_tp_is_a_sharding_error():
    with pytest.raises(autopar.ShardingError) as info:
        _plan(build_model("gpt_tiny", hidden=48, num_heads=3), {"tp": 2})
    _check(info, autopar.ShardingError, what="has size 3, not divisible by tp=2", where="module model.blocks.0.attn",
           fix="divides the attention heads")


def test_kv_heads_not_divisible_by_tp_is_a_sharding_error():
    """3 kv heads on tp=2: neither divides the other, so no rank can hold whole kv heads."""
    with pytest.raises(autopar.ShardingError) as info:
        _plan(build_model("llama_tiny", num_heads=6, num_kv_heads=3, hidden=48), {"tp": 2})
    _check(info, autopar.ShardingError, what="has size 3, not divisible by tp=2", where="module model.layers.0.attn",
           fix="kv heads")


def test_fewer_kv_heads_than_tp_are_replicated_not_refused():
    result = _plan(build_model("llama_tiny"), {"tp": 4})  # 2 kv heads, each held by 2 of the 4 ranks
    shards = result.plan.param_shards
    assert shards["layers.0.attn.k_proj.weight"].parts == 2 and shards["layers.0.attn.q_proj.weight"].parts == 0


def test_hidden_not_divisible_by_tp_is_a_sharding_error():
    model = build_model("mlp_tiny", hidden=33)
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    with pytest.raises(autopar.ShardingError) as info:
        autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=nn.functional.mse_loss, example_target=y)
    _check(info, autopar.ShardingError, what="has size 33, not divisible by tp=2", where="module model.layers.0",
           fix="hidden sizes")


def test_batch_not_divisible_by_dp_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"dp": 2}, batch=5)
    _check(info, autopar.PlanError, what="batch size 5 is not divisible by dp=2", where="example_inputs, dim 0",
           fix="multiple of dp")


def test_batch_not_divisible_by_microbatches_times_dp_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"dp": 2}, batch=6, num_microbatches=2)
    _check(info, autopar.PlanError, what="not divisible by microbatches=2 x dp=2", where="example_inputs",
           fix="multiple of 4")


def test_pp_larger_than_the_blocks_allow_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:  # 2 blocks: at most 4 stages
        _plan(gpt, {"pp": 5}, batch=10, schedule="gpipe")
    _check(info, autopar.PlanError, what="at most 4 pipeline stages", where="'pp' x num_virtual",
           fix="pp x num_virtual <= 4")


def test_unknown_model_preset_is_a_plan_error():
    with pytest.raises(autopar.PlanError) as info:
        build_model("gpt5")
    _check(info, autopar.PlanError, what="unknown model preset 'gpt5'", where="build_model", fix="gpt_tiny")


# --- capture --------------------------------------------------------------------------------

class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.proj(x)
        return x


@pytest.mark.parametrize("mode", ["export", "symbolic_trace"])
def test_untraceable_model_is_a_capture_error(mode):
    lines, start = inspect.getsourcelines(DataDependent.forward)
    line = start + next(i for i, text in enumerate(lines) if "if x.sum()" in text)
    with pytest.raises(autopar.CaptureError) as info:
        autopar.plan(DataDependent(), {"dp": 1}, example_inputs=(torch.randn(2, 4),), capture=mode)
    _check(info, autopar.CaptureError, what=f"{mode} could not capture DataDependent",
           where=f"{__file__}:{line} in forward: if x.sum() > 0:", fix="control flow")


def test_loss_fn_without_target_is_an_autopar_error(gpt):
    x, _ = _batch()
    with pytest.raises(autopar.AutoparError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=(x,), loss_fn=lm_loss)
    assert info.value.where and "example_target" in info.value.fix


# --- options and schedules ------------------------------------------------------------------

def test_unknown_schedule_name_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"pp": 2}, schedule="zigzag")
    _check(info, autopar.PlanError, what="unknown schedule 'zigzag'", where="CompileOptions.schedule",
           fix="gpipe, 1f1b")


def test_unknown_option_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"pp": 2}, microbatches=4)
    _check(info, autopar.PlanError, what="unknown field 'microbatches'", where="CompileOptions.microbatches",
           fix="num_microbatches")


def test_zero_stage_out_of_range_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"dp": 2}, zero_stage=4)
    _check(info, autopar.PlanError, what="zero_stage", where="CompileOptions.zero_stage (got 4)",
           fix="less than or equal to 3")


def test_zero3_with_a_split_backward_schedule_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"dp": 2, "pp": 2}, batch=8, schedule="zb_h1", num_microbatches=2, zero_stage=3)
    _check(info, autopar.PlanError, what="zero_stage=3 does not combine with the split-backward schedule 'zb_h1'",
           where="compile(zero_stage=3", fix="zero_stage<=2")


def test_selective_recompute_with_a_split_backward_schedule_is_a_plan_error(gpt):
    with pytest.raises(autopar.PlanError) as info:
        _plan(gpt, {"pp": 2}, schedule="zb_h1", num_microbatches=2, recompute="selective")
    _check(info, autopar.PlanError, what="recompute='selective' does not combine with the split-backward schedule",
           where="stage(s) [0, 1]", fix="recompute='full'")


def test_1f1b_with_fewer_microbatches_than_stages_is_a_schedule_error():
    model = build_model("gpt_tiny", num_layers=4)
    with pytest.raises(autopar.ScheduleError) as info:
        _plan(model, {"pp": 4}, num_microbatches=2)
    _check(info, autopar.ScheduleError, what="1f1b needs num_microbatches >= 4", where="schedule '1f1b'",
           fix="raise num_microbatches to 4")
