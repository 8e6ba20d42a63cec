"""A transformers model built on meta, compiled: each rank materialises only its own pieces, drawn by
the model's own initialisers, and trains equal to the same model built on CPU under the same seed.

The per-rank values are checked without processes (every rank of a dp=2 x pp=2 x tp=2 ZeRO-3 plan,
against the CPU build cut the same way); training runs in one spawned 4-rank group.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.errors import PlanError  # noqa: E402
from autopar.models.hf import build_hf_raw  # noqa: E402
from autopar.ops.zero3_ops import padded_numel, shard_zero3_parameters  # noqa: E402
from autopar.runtime.checkpoints.checkpoint_layout import split  # noqa: E402
from autopar.runtime.execution.init_replay import init_filler  # noqa: E402
from autopar.runtime.state.materialize import materialize_rank  # noqa: E402
from case_marks import by_world  # noqa: E402
from equivalence import Case, assert_equivalent, run_cases  # noqa: E402
from hf_runners import cpu_reference, hf_loop_reference, logits_loss, padded_batches  # noqa: E402

# families whose construction draws only through reset_parameters and post_init (GPT-2's Conv1D
# draws in __init__ itself: its meta build gets the library's distribution, not the CPU build's draws)
EXACT = ("llama", "mixtral", "bert", "qwen3", "phi3")  # phi3: its fused qkv cut in unequal blocks at tp=2


def _held(gms):
    out = {}
    for gm in gms:
        out.update(dict(gm.named_parameters()))
        out.update(dict(gm.named_buffers()))
    return out


@pytest.mark.parametrize("name", EXACT)
def test_each_rank_materialises_its_pieces_of_the_cpu_build(name):
    torch.manual_seed(0)
    cpu = build_hf_raw(name, use_cache=False)
    full = {**dict(cpu.named_parameters(remove_duplicate=False)), **dict(cpu.named_buffers(remove_duplicate=False))}
    meta = build_hf_raw(name, device="meta", use_cache=False)
    x, t = torch.randint(0, 128, (8, 8)), torch.randint(0, 128, (8, 8))
    result = autopar.plan(meta, {"dp": 2, "pp": 2, "tp": 2}, example_inputs=(x,), loss_fn=logits_loss,
                          example_target=t, zero_stage=3, ranks=[0, 3, 6])
    largest_module = max(sum(t.numel() * t.element_size() for t in list(m.parameters(recurse=False))
                             + list(m.buffers(recurse=False))) for m in cpu.modules())
    for rank in (0, 3, 6):
        ranked = result.rank_program(rank)
        gms = [copy.deepcopy(s.gm) for s in ranked.stages]
        shard_zero3_parameters(gms, dims=result.plan.dims, coords=ranked.coords)
        fill = init_filler(meta, seed=0)
        slots = materialize_rank(gms, plan=result.plan, coords=ranked.coords, fill=fill)
        assert 0 < fill.peak_bytes <= largest_module  # one module's full-size tensors at a time, never the model
        held = _held(gms)
        assert slots and all(not t.is_meta for t in held.values())
        for slot in slots:
            want = split(full[slot.name].detach(), slot.layout, tp_index=slot.tp_index, z_index=slot.z_index)
            got = held.get("model." + slot.name)
            if got is not None:  # (a tie held under its other name is the same tensor)
                torch.testing.assert_close(got.detach(), want, rtol=0, atol=0, msg=f"rank {rank} {slot.name}")
    assert all(p.is_meta for p in meta.parameters())


def test_uninitialised_tensor_is_refused_naming_the_module():
    class Gain(torch.nn.Module):  # a parameter no initialiser sets
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.gain = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.lin(x) * self.gain

    with torch.device("meta"):
        model = Gain()
    result = autopar.plan(model, {"tp": 1}, example_inputs=(torch.randn(2, 4),))
    gms = [copy.deepcopy(s.gm) for s in result.ranks[0].stages]
    with pytest.raises(PlanError, match="gain") as info:
        materialize_rank(gms, plan=result.plan, coords={"dp": 0, "pp": 0, "tp": 0}, fill=init_filler(model, seed=0))
    assert "reset_parameters" in info.value.fix


def _cpu_numel(case) -> dict[str, int]:
    model = build_hf_raw(case.model, device="meta", **dict(case.overrides))
    return {n: p.numel() for n, p in model.named_parameters()}


_CASES = [Case(model="llama", mesh=(1, 2, 2), kind="hf_runners:meta_train", overrides=(("use_cache", False),)),
          Case(model="llama", mesh=(2, 1, 2), kind="hf_runners:meta_train", overrides=(("use_cache", False),),
               options=(("zero_stage", 3),))]


# HF models as users hold them: library defaults (use_cache=True) with a logits loss, and dict batches
# with labels and padding on the model's own loss (built on meta), against HF's own single-device loop;
# the padding differs between microbatches and dp slices (num_items_in_batch counts the whole step)
_DICT = (("dict", True),)
_HF_CASES = [Case(model="llama", mesh=(1, 2, 2), kind="hf_runners:hf_train"),
             Case(model="llama", mesh=(1, 2, 2), kind="hf_runners:hf_train", extra=_DICT + (("meta", True),)),
             Case(model="llama", mesh=(2, 1, 2), kind="hf_runners:hf_train", extra=_DICT),
             Case(model="llama", mesh=(2, 2, 1), kind="hf_runners:hf_train", extra=_DICT,
                  options=(("schedule", "1f1b"),)),
             # the DataParallel baseline on a dict batch, its loss_fn computed on rank 0 over the whole batch
             Case(model="llama", mesh=(2, 1, 2), kind="hf_runners:hf_train", extra=(("dict_loss_fn", True),),
                  options=(("data_parallel", "dataparallel"),))]


@functools.lru_cache(maxsize=None)
def _results():
    cases = _CASES + _HF_CASES
    return dict(zip(cases, run_cases(cases)))


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(_CASES, ids=lambda c: c.name()))
def test_meta_built_model_trains_equal_to_cpu_build(case):
    result = _results()[case]
    assert_equivalent(case, result, cpu_reference(case))
    assert result["still_meta"]
    # rank 0 holds exactly its pieces: tp shards of its stages' weights (ZeRO-3: their flat dp blocks)
    dp, _, tp = case.mesh
    zero3 = dict(case.options).get("zero_stage") == 3
    cpu = _cpu_numel(case)
    expected = 0
    for name, numel in result["local_numel"].items():
        full = cpu[name] // (tp if name in result["sharded"] else 1)
        expected += padded_numel(full, dp) // dp if zero3 else full
        assert numel == (padded_numel(full, dp) // dp if zero3 else full), name
    assert result["held_bytes"] == 4 * expected < result["model_bytes"] / 2


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(_HF_CASES, ids=lambda c: c.name()))
def test_hf_model_as_users_hold_it_trains_equal_to_hf_single_device_loop(case):
    result = _results()[case]
    assert_equivalent(case, result, hf_loop_reference(case))
    assert result["use_cache"] is True  # the user's config is left as it was
    if case.mesh[2] == 1:
        return
    projections = [n for n in result["sharded"] if n.endswith(("q_proj.weight", "o_proj.weight", "down_proj.weight"))]
    assert len(projections) == 3 * 2, result["sharded"]  # every attention and MLP projection, both layers
    assert "lm_head.weight" in result["sharded"]  # on vocabulary shards, the loss's sum too (num_items_in_batch)


def test_padding_differs_between_microbatches_and_dp_slices():
    """The dict cases' data: each microbatch of each dp slice holds its own number of label tokens."""
    for case in _HF_CASES[1:4]:
        dp, pp, _ = case.mesh
        rows = case.batch // (dp * 2 * pp)  # the default microbatch count: 2 x pp
        for batch in padded_batches(case):
            counts = [int((batch["labels"][r:r + rows, 1:] != -100).sum()) for r in range(0, case.batch, rows)]
            per_mb = len(counts) // dp
            per_slice = [sum(counts[k * per_mb:(k + 1) * per_mb]) for k in range(dp)]
            assert len(set(counts)) > 1 and len(set(per_slice)) == dp, (counts, per_slice)


def test_meta_built_model_trains_in_bf16_as_the_cpu_build(one_rank_mesh):
    """precision='bf16': a meta-built model's fp32 masters are its materialised pieces, so it steps
    exactly as the same family built on CPU under the same seed (same masters, same bf16 copies)."""
    batch = padded_batches(Case(steps=2, batch=4, seq=8))

    def run(device):
        torch.manual_seed(0)
        model = build_hf_raw("llama", device=device)
        program = autopar.compile(model, one_rank_mesh, example_inputs=batch[0], precision="bf16",
                                  optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
        assert program.mixed is not None
        return [program.train_step(b).item() for b in batch], program.full_state_dict()

    (meta_losses, meta_state), (cpu_losses, cpu_state) = run("meta"), run(None)
    assert meta_losses == cpu_losses
    assert meta_state.keys() == cpu_state.keys()
    for name, value in cpu_state.items():
        assert value.dtype == meta_state[name].dtype and torch.equal(meta_state[name], value), name
