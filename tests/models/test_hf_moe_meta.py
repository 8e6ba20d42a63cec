"""A Hugging Face MoE model built on meta, its experts split over ep: each ep rank materialises only its
own experts (1/ep of dim 0 of every fused 3-D expert tensor, each cut over tp too), drawn by the model's
own initialisers or read from a folder in the model's own names (compile's ``weights=`` filler), equal to
the CPU build cut the same way; the filler reads no element the rank does not hold.

Read off the lowered graphs of every (ep, tp) rank without processes; training runs in the spawned groups
of tests/runtime/test_moe_expert_parallel_dist.py.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from autopar.hf import pretrained_weights  # noqa: E402
from autopar.lowering import capture_and_annotate, lower_captured  # noqa: E402
from autopar.models.moe import build_hf_moe  # noqa: E402
from autopar.plan_model import MeshShape  # noqa: E402
from autopar.runtime.checkpoints.checkpoint_layout import split  # noqa: E402
from autopar.runtime.execution.init_replay import init_filler  # noqa: E402
from autopar.runtime.state.materialize import materialize_rank  # noqa: E402
from autopar.validation import checked_options  # noqa: E402


def _lowered(model, *, dp: int, tp: int, ep: int):
    """{(dp index, tp index): that rank's lowering} of ``model`` with its experts split over ``ep``."""
    shape = MeshShape(dp=dp, pp=1, tp=tp)
    idx = torch.randint(0, 64, (2 * dp, 8), generator=torch.Generator().manual_seed(3))
    opts = checked_options(dict(expert_parallel=ep, zero_stage=0, num_microbatches=1), mesh=shape, plan=None,
                           where="test")
    cap = capture_and_annotate(model, mesh=shape, example_inputs={"input_ids": idx, "labels": idx}, options=opts)
    return {(d, t): lower_captured(cap, tp_rank=t, dp_rank=d) for d in range(ep) for t in range(tp)}


def _held(gms) -> dict:
    out = {}
    for gm in gms:
        out.update(dict(gm.named_parameters()))
        out.update(dict(gm.named_buffers()))
    return out


@pytest.mark.parametrize("family,tp", [("mixtral", 1), ("qwen3_moe", 2)])
def test_each_ep_rank_materialises_only_its_experts(family, tp, tmp_path):
    torch.manual_seed(0)
    cpu = build_hf_moe(family)
    full = {**dict(cpu.named_parameters()), **dict(cpu.named_buffers())}
    cpu.save_pretrained(tmp_path, save_original_format=False)  # the model's own names: fused 3-D experts
    with torch.device("meta"):
        meta = build_hf_moe(family)
    ep = 2
    for (d, t), lowered in _lowered(meta, dp=2, tp=tp, ep=ep).items():
        experts = set(lowered.plan.expert_params)
        assert len(experts) == 4  # two fused expert tensors per layer, two layers
        coords = {"dp": d, "pp": 0, "tp": t}
        for fill in (init_filler(meta, seed=0), pretrained_weights(str(tmp_path), meta)):
            gms = [copy.deepcopy(s.gm) for s in lowered.stages]
            slots = materialize_rank(gms, plan=lowered.plan, coords=coords, fill=fill)
            held = _held(gms)
            assert all(not v.is_meta for v in held.values())
            for slot in slots:
                want = split(full[slot.name].detach(), slot.layout, tp_index=slot.tp_index, z_index=slot.z_index,
                             ep_index=slot.ep_index)
                torch.testing.assert_close(held["model." + slot.name].detach(), want, rtol=0, atol=0,
                                           msg=f"rank (dp={d}, tp={t}) {slot.name}")
                if slot.name in experts:  # this ep rank's experts, each tp-cut: 1/(ep*tp) of the elements
                    assert slot.ep_index == d and slot.layout.ep == ep
                    assert held["model." + slot.name].numel() * ep * tp == full[slot.name].numel()
                    assert torch.equal(held["model." + slot.name].detach(), want)
            if hasattr(fill, "elements_read"):  # the folder: only the pieces this rank holds were read
                saved = {s.name for s in slots} - {n for n, _ in cpu.named_buffers()}
                assert fill.elements_read == sum(math.prod(s.layout.piece_shape()) for s in slots if s.name in saved)
    assert all(p.is_meta for p in meta.parameters())
