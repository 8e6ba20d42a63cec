"""The GPU path on one GPU: a world of one rank, programs on CUDA against eager on CUDA.

The ``gpu``-marked cases skip without CUDA (tests/conftest.py); ``bench/gpu_check.sh`` runs this file and the GPU
benchmark in one go. Eager and autopar run the same kernels in fp32 (TF32 off), so they agree to
fp32 rounding (the harness's tolerances, tests/equivalence.py); bf16 is judged against fp32 eager within bf16's resolution (8 bits of mantissa).
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss
from equivalence import ATOL, RTOL

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
#: the meta-built case also runs on CPU in the default suite: the GPU test's code is exercised everywhere
BOTH = ["cpu", CUDA]

STEPS = 3


def _batches(model, *, batch: int = 8, seq: int = 16, device="cuda"):
    """``STEPS`` (tokens, targets) batches over the model's vocabulary, on ``device``."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.lm_head.weight.shape[0]
    return [(torch.randint(vocab, (batch, seq), generator=gen).to(device),
             torch.randint(vocab, (batch, seq), generator=gen).to(device)) for _ in range(STEPS)]


def _sgd(params):
    """The harness's default optimizer (tests/equivalence.py): SGD with momentum, whose update is linear in
    the gradient, so fp32 rounding stays rounding (AdamW's m / sqrt(v) turns a near-zero gradient's
    rounding into a step of up to lr)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _eager(model, data):
    opt = _sgd(model.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _autopar(model, mesh, data, **options):
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              optimizer=_sgd, **options)
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    return losses, {k: v.float().cpu() for k, v in program.full_state_dict().items()}, program


def _on(program, device: str) -> bool:
    return all(t.device.type == device for s in program.stages.values() for t in [*s.gm.parameters(), *s.gm.buffers()])


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["gpt_tiny", "llama_tiny"])
def test_fp32_program_on_cuda_equals_eager(mesh_on, model_name):
    mesh = mesh_on("cuda")
    torch.manual_seed(0)
    model = build_model(model_name).cuda()
    data = _batches(model)
    want_losses, want_state = _eager(copy.deepcopy(model), data)
    got_losses, got_state, program = _autopar(model, mesh, data)
    assert _on(program, "cuda")
    torch.testing.assert_close(got_losses, want_losses, rtol=RTOL, atol=ATOL)
    for name, want in want_state.items():
        torch.testing.assert_close(got_state[name], want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("device", BOTH)
def test_meta_built_model_materialises_on_the_device(mesh_on, device):
    """autopar's own Llama on meta: its rotary tables come from ``torch.arange(device=self.cos.device)`` in
    ``reset_buffers``, a factory asking for meta, which the init replay must build for real."""
    mesh = mesh_on(device)
    torch.manual_seed(0)
    eager = build_model("llama_tiny").to(device)
    with torch.device("meta"):
        meta = build_model("llama_tiny")
    data = _batches(eager, device=device)
    want_losses, _ = _eager(eager, data)
    torch.manual_seed(0)  # the init replay draws global rank 0's initial seed: the same stream as the eager build
    got_losses, _, program = _autopar(meta, mesh, data)
    assert _on(program, device)
    torch.testing.assert_close(got_losses, want_losses, rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
def test_bf16_program_on_cuda_is_within_bf16_resolution_of_fp32_eager(mesh_on):
    mesh = mesh_on("cuda")
    torch.manual_seed(0)
    model = build_model("llama_tiny").cuda()
    data = _batches(model)
    want_losses, _ = _eager(copy.deepcopy(model), data)
    got_losses, got_state, _ = _autopar(model, mesh, data, precision="bf16")
    assert all(v.dtype == torch.float32 for v in got_state.values())  # fp32 masters handed back
    torch.testing.assert_close(got_losses, want_losses, rtol=2 ** -7, atol=0)  # bf16 keeps 8 mantissa bits


@pytest.mark.gpu
def test_memory_estimate_is_within_ten_percent_of_the_cuda_peak_for_a_1b_llama(mesh_on):
    """A 1B-parameter Llama shape (16 layers, hidden 2048, 16 heads, SwiGLU 5632, sequence 1024),
    AdamW in fp32: the calculator's peak against ``torch.cuda.max_memory_allocated`` of one step."""
    from autopar.memory import estimate_memory
    mesh = mesh_on("cuda")
    fields = dict(num_layers=16, hidden=2048, num_heads=16, num_kv_heads=16, intermediate=5632, seq_len=1024,
                  vocab_size=32000)
    with torch.device("meta"):
        meta = build_model("llama_tiny", **fields)
    x = torch.randint(32000, (4, 1024))
    estimate = estimate_memory(autopar.plan(meta, {"dp": 1}, example_inputs=(x,), loss_fn=lm_loss,
                                            example_target=x, num_microbatches=1), optimizer="adamw")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    program = autopar.compile(meta, mesh, example_inputs=(x.cuda(),), loss_fn=lm_loss, example_target=x.cuda(),
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), num_microbatches=1)
    for _ in range(2):  # the second step holds the optimizer state from the start
        program.train_step(program.shard_batch(x.cuda()), target=program.shard_batch(x.cuda()))
    measured = torch.cuda.max_memory_allocated() - base
    predicted = estimate.ranks[0].total
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
