"""A fused projection sharded in unequal blocks (Phi-3's [q | k | v] with fewer kv heads, at tp=2) has no
checkpoint Layout yet: checkpoints, weight files and meta materialisation refuse it by name instead of
cutting it as equal blocks (a silent wrong result)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.errors import CheckpointError, PlanError  # noqa: E402
from autopar.runtime.materialize import rank_slots  # noqa: E402
from autopar.runtime.rank_tensors import held_tensors  # noqa: E402
from tp_families import build_family, example_batch, logits_loss  # noqa: E402


def _plan_phi3(device=None):
    with torch.device(device or "cpu"):
        model = build_family("phi3")
    x, y = example_batch()
    return autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=logits_loss, example_target=y)


@pytest.fixture(scope="module")
def phi3_tp2():
    result = _plan_phi3()
    blocked = [n for n, s in result.plan.param_shards.items() if s.blocks]
    assert blocked, "Phi-3's fused qkv is expected in unequal blocks at tp=2"
    return result, blocked[0]


def test_checkpoints_and_weight_files_refuse_unequal_blocks(phi3_tp2):
    result, name = phi3_tp2
    held = torch.zeros(3, 3)  # the refusal comes before any shape is read
    program = SimpleNamespace(plan=result.plan, info=SimpleNamespace(coords={"tp": 0, "dp": 0, "pp": 0}, rank=0),
                              stages={}, aliases={}, parameter_values=lambda: [(name, held)])
    with pytest.raises(CheckpointError, match=f"{name} is sharded over tp in unequal blocks") as err:
        held_tensors(program)
    assert "full_state_dict" in err.value.fix


def test_meta_materialisation_refuses_unequal_blocks():
    result = _plan_phi3("meta")
    with pytest.raises(PlanError, match="cannot materialise it yet"):
        rank_slots([s.gm for s in result.lowered[0].stages], plan=result.plan, coords={"tp": 0, "dp": 0, "pp": 0})
