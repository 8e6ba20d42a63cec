"""Tensor parallelism: autopar tp=2 against DTensor ``parallelize_module``, one run, 2 gloo ranks.

GPT's fused ``qkv`` linear cannot be sharded head-aware by ``ColwiseParallel`` (it would cut the
[q; k; v] rows in two contiguous halves, not per head), so both contenders train the Llama-style
model (separate q/k/v/o and gate/up/down, 8 heads, 8 kv heads, 8 layers, width 256, SwiGLU 704,
sequence 64) on the same character batches (batch 32) with ``lm_loss`` and AdamW(lr=1e-3):

- autopar: ``autopar.compile`` on a (dp=1, pp=1, tp=2) mesh, ``num_microbatches=1`` (the same
  work as the peer's single pass; the auto plan picks 2 microbatches, timed as an extra row).
- peer: torchtitan's recipe: per layer ``parallelize_module`` with ColwiseParallel on q/k/v/gate/
  up and RowwiseParallel on o/down, and the attention's ``num_heads``/``num_kv_heads``/``hidden``
  set to their per-rank values so the head reshapes see local sizes. Embedding, norms and the
  head stay replicated plain tensors (as in autopar's plan).

    python bench/bench_tensor_parallel.py          # ~1.5 min; prints a table, updates docs
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from torch import nn

from _report import console_table, markdown_table, run_note, stamped, update_section
from _spawn import spawn
from _timing import Contender, measure, ratio_summary

__all__ = ["MODEL", "run", "section", "main", "TP_PLAN"]

MODEL = dict(name="llama_tiny", num_layers=8, hidden=256, num_heads=8, num_kv_heads=8,
             intermediate=704, seq_len=64)
BATCH = 32
NUM_BATCHES = 4
SEED = 0

#: The peer's per-layer plan: module path -> style (as torchtitan writes it).
TP_PLAN = {
    "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    from autopar.models import TextBatches
    it = iter(TextBatches(seq_len=MODEL["seq_len"], batch_size=BATCH, seed=SEED))
    return [next(it) for _ in range(NUM_BATCHES)]


def _build_model() -> nn.Module:
    from autopar.models import build_model
    torch.manual_seed(SEED)
    return build_model(MODEL["name"], **{k: v for k, v in MODEL.items() if k != "name"})


def _autopar_contender(model: nn.Module, data, num_microbatches: int | None) -> tuple[Contender, object]:
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=_optimizer,
                              num_microbatches=num_microbatches)
    program.compile_s = time.perf_counter() - t0

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    m = program.plan.pipeline.num_microbatches
    label = "auto plan" if num_microbatches is None else "tp=2"
    return Contender(f"autopar {label} ({m} mb)", step), program


def parallelize_llama(model: nn.Module, tp_mesh) -> nn.Module:
    """torchtitan-style TP of every layer; attention head counts become per-rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp = tp_mesh.size()
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {name: styles[s]() for name, s in TP_PLAN.items()})
        attn = layer.attn
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        attn.hidden //= tp
    return model


def _peer_contender(model: nn.Module, data) -> Contender:
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    peer = parallelize_llama(copy.deepcopy(model), tp_mesh)
    opt = _optimizer(list(peer.parameters()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss = lm_loss(peer(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return Contender("DTensor parallelize_module", step)


def _row(case: str, ap: Contender, peer: Contender, mine, theirs, program) -> dict:
    r = ratio_summary(mine, theirs)
    return dict(case=case, autopar=ap.name, peer=peer.name, autopar_s=mine.median_s, peer_s=theirs.median_s,
                ratio=r["ratio"], round_range=f"{r['round_ratio_min']:.3f}-{r['round_ratio_max']:.3f}",
                loss1=f"{mine.first_loss:.5f} / {theirs.first_loss:.5f}",
                loss_last=f"{mine.last_loss:.5f} / {theirs.last_loss:.5f}", steps=mine.num_steps,
                compile_s=program.compile_s, events=list(program.events))


def body(rank: int, world: int, variants: tuple, rounds: int, steps_per_round: int, warmup: int) -> list[dict]:
    """Every rank: for each autopar variant build both contenders from the same weights and time them."""
    assert world == 2, "the tensor-parallel benchmark runs on 2 ranks"
    data = _data()
    model = _build_model()
    rows = []
    for num_microbatches in variants:
        ap, program = _autopar_contender(model, data, num_microbatches)
        peer = _peer_contender(model, data)
        mine, theirs = measure([ap, peer], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
        rows.append(_row("Llama 8x256 tp=2, batch 32", ap, peer, mine, theirs, program))
        del program
    return rows


def run(*, variants=(1, None), rounds: int = 6, steps_per_round: int = 4, warmup: int = 3) -> list[dict]:
    """Spawn 2 gloo ranks, run the benchmark, return rank 0's rows (stamped with date and load)."""
    return stamped(spawn, body, world_size=2, args=(tuple(variants), rounds, steps_per_round, warmup),
                   timeout_s=600)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    return "\n".join([
        "## Tensor parallelism: autopar tp=2 vs DTensor parallelize_module",
        "",
        run_note(rows),
        "",
        f"Model: Llama-style, {MODEL['num_layers']} layers, hidden {MODEL['hidden']}, {MODEL['num_heads']} heads "
        f"({MODEL['num_kv_heads']} kv heads), SwiGLU {MODEL['intermediate']}, sequence {MODEL['seq_len']}, "
        f"vocab 128, untied head (6.49M parameters). Batch {BATCH}, `lm_loss`, AdamW(lr=1e-3).",
        "Peer: ColwiseParallel on q/k/v/gate/up, RowwiseParallel on o/down, per-rank head counts on the "
        "attention modules (torchtitan's recipe). GPT's fused qkv is not used here: ColwiseParallel would "
        "cut it into two contiguous halves instead of per head.",
        "",
        markdown_table(rows),
        "",
        "autopar compile time (not in the step times): "
        + ", ".join(f"{r['autopar']} {r['compile_s']:.1f} s" for r in rows) + ".",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-auto", action="store_true", help="skip the auto-plan (2 microbatch) row")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    variants = (1,) if args.no_auto else (1, None)
    rows = run(variants=variants, rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup)
    print(console_table(rows))
    if not args.no_doc:
        update_section("tensor_parallel", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
