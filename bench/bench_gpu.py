"""The GPU path on one GPU: autopar's single-stage program against eager PyTorch, and its MFU.

A world of one rank (NCCL, ``cuda:0``); both contenders train their own copy of the same
1B-parameter Llama shape (16 layers, hidden 2048, 16 heads, SwiGLU 5632, vocab 32000, sequence
1024; batch 4) with ``lm_loss`` and AdamW(lr=1e-4), TF32 matmuls allowed on both sides. Steps
alternate in rounds (``bench/_timing.py``: ``torch.cuda.synchronize`` inside the barrier-bracketed
step, so a step's wall time is its GPU time). MFU is ``6 x parameters x tokens`` (plus the
attention's ``12 x layers x hidden x sequence`` per token) per second over ``--peak-tflops``
(default: an H200's dense TF32 figure, 494.7).

    bash bench/gpu_check.sh            # the gpu tests, then this benchmark; writes docs/benchmarks.md
    python bench/bench_gpu.py --rounds 4
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from _report import markdown_table, run_note, stamped, update_section
from _timing import DEFAULTS, Contender, cuda_synced, measure, row_cells

__all__ = ["SHAPE", "run", "section", "main"]

SHAPE = dict(num_layers=16, hidden=2048, num_heads=16, num_kv_heads=16, intermediate=5632, seq_len=1024,
             vocab_size=32000)
BATCH = 4


def _model():
    from autopar.models import build_model
    torch.manual_seed(0)
    with torch.device("cuda"):
        return build_model("llama_tiny", **SHAPE)


def _data(count: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"]), generator=g).cuda(),
             torch.randint(SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"]), generator=g).cuda()) for _ in range(count)]


def _eager(model, data) -> Contender:
    from autopar.models import lm_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return Contender("eager PyTorch", cuda_synced(step))


def _autopar(model, data, mesh) -> tuple[Contender, object]:
    import autopar
    from autopar.models import lm_loss
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), num_microbatches=1)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender("autopar (1 rank, 1 stage)", cuda_synced(step)), program


def _flops_per_step(params: int) -> float:
    tokens = BATCH * SHAPE["seq_len"]
    attention = 12 * SHAPE["num_layers"] * SHAPE["hidden"] * SHAPE["seq_len"]
    return (6 * params + attention) * tokens


def body(rounds: int, steps_per_round: int, warmup: int, peak_tflops: float) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    with tempfile.TemporaryDirectory() as tmp:
        # CPU tensors over gloo: bench/_timing.py sums each step's CPU time with an all_reduce of a CPU tensor,
        # which a NCCL-only group refuses (torch's Backend.backend_capability: nccl serves cuda alone)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0,
                                world_size=1)
        try:
            mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
            data = _data()
            model = _model()
            params = sum(p.numel() for p in model.parameters())
            eager = _eager(copy.deepcopy(model), data)
            mine, program = _autopar(model, data, mesh)
            ours, theirs = measure([mine, eager], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
        finally:
            dist.destroy_process_group()
    flops = _flops_per_step(params)
    return [dict(case=f"Llama 1B shape ({params / 1e9:.2f}B), batch {BATCH} x {SHAPE['seq_len']}, fp32 (TF32)",
                 **row_cells(ours, theirs), mfu=flops / ours.median_s / (peak_tflops * 1e12),
                 eager_mfu=flops / theirs.median_s / (peak_tflops * 1e12), peak_tflops=peak_tflops,
                 device=torch.cuda.get_device_name(0), max_memory_gib=torch.cuda.max_memory_allocated() / 2 ** 30)]


def run(*, rounds: int = 8, steps_per_round: int = 2, warmup: int = DEFAULTS["warmup"],
        peak_tflops: float = 494.7) -> list[dict]:
    return stamped(body, rounds, steps_per_round, warmup, peak_tflops)


def section(rows: list[dict]) -> str:
    r = rows[0]
    return "\n".join([
        "## The GPU path: one GPU, autopar's single-stage program vs eager",
        "",
        run_note(rows).replace("(2 cores)", f"({r['device']})"),
        "",
        markdown_table(rows),
        "",
        f"MFU (model FLOPs over {r['peak_tflops']:g} TFLOP/s): autopar {r['mfu']:.1%}, eager {r['eager_mfu']:.1%}; "
        f"peak memory allocated {r['max_memory_gib']:.1f} GiB.",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--peak-tflops", type=float, default=494.7)
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured", file=sys.stderr)
        return []
    rows = run(rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup,
               peak_tflops=args.peak_tflops)
    r = rows[0]
    print(f"{r['case']}: autopar / eager {r['ratio']:.3f} (rounds {r['round_iqr']}), MFU {r['mfu']:.1%}")
    if not args.no_doc:
        update_section("gpu", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
