"""Tensor parallelism: autopar tp=2 against DTensor ``parallelize_module``, one run, 2 gloo ranks.

GPT's fused ``qkv`` linear cannot be sharded head-aware by ``ColwiseParallel`` (it would cut the
[q; k; v] rows in two contiguous halves, not per head), so both contenders train the Llama-style
model (separate q/k/v/o and gate/up/down, 8 heads, 8 kv heads, 8 layers, width 256, SwiGLU 704,
sequence 64) on the same character batches (batch 32) with ``lm_loss`` and AdamW(lr=1e-3):

- autopar: ``autopar.compile`` on a (dp=1, pp=1, tp=2) mesh, ``num_microbatches=1`` (the same
  work as the peer's single pass; the auto plan picks 2 microbatches: variant ``auto``).
- peer: torchtitan's recipe: per layer ``parallelize_module`` with ColwiseParallel on q/k/v/gate/
  up and RowwiseParallel on o/down, and the attention's ``num_heads``/``num_kv_heads``/``hidden``
  set to their per-rank values so the head reshapes see local sizes.

Two variants (see :data:`VARIANTS`): ``blocks`` shards only those linears on both sides
(autopar with ``vocab_parallel=False``); ``blocks+vocab`` is autopar's default plan (embedding,
head and cross entropy sharded on the vocabulary) against the peer with torchtitan's embedding
RowwiseParallel, head ColwiseParallel (logits kept sharded) and ``loss_parallel()``.

    python bench/bench_tensor_parallel.py          # ~2 min; prints a table, updates docs
    python bench/bench_tensor_parallel.py --variants blocks auto --no-doc
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from torch import nn

from _setup import adamw, seeded_model, text_batches
from _report import console_table, markdown_table, run_note, stamped, update_section
from _spawn import spawn
from _timing import DEFAULTS, Contender, measure, row_cells

__all__ = ["MODEL", "TP_PLAN", "VARIANTS", "parallelize_llama", "run", "section", "main"]

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


_optimizer = adamw


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return text_batches(MODEL, batch=BATCH, seed=SEED, count=NUM_BATCHES)


def _build_model() -> nn.Module:
    return seeded_model(MODEL, seed=SEED)


#: Variants: name -> (autopar compile options, peer shards the vocabulary too).
#: "blocks": only the attention/MLP linears are sharded on both sides.
#: "blocks+vocab": autopar's default plan (embedding, head and cross entropy vocabulary-parallel);
#:   the peer adds torchtitan's RowwiseParallel embedding, ColwiseParallel head with logits kept
#:   sharded, and ``loss_parallel()`` around the loss and its backward.
#: "auto": autopar's fully automatic plan (microbatch count included) against "blocks+vocab".
VARIANTS = {
    "blocks": ({"num_microbatches": 1, "vocab_parallel": False}, False),
    "blocks+vocab": ({"num_microbatches": 1}, True),
    "auto": ({}, True),
}


def _autopar_contender(model: nn.Module, data, variant: str) -> tuple[Contender, object]:
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    options = dict(VARIANTS[variant][0])
    if "vocab_parallel" not in autopar.CompileOptions.model_fields:
        options.pop("vocab_parallel", None)  # an autopar without the option shards no vocabulary
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=_optimizer, **options)
    program.compile_s = time.perf_counter() - t0

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    m = program.plan.pipeline.num_microbatches
    return Contender(f"autopar {variant} ({m} mb)", step), program


def parallelize_llama(model: nn.Module, tp_mesh, *, vocab: bool) -> nn.Module:
    """torchtitan-style TP of every layer (attention head counts become per-rank); with ``vocab``
    also the embedding (rowwise) and the head (colwise, logits left sharded for loss_parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp = tp_mesh.size()
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {name: styles[s]() for name, s in TP_PLAN.items()})
        attn = layer.attn
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        attn.hidden //= tp
    if vocab:
        parallelize_module(model, tp_mesh, {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
    return model


def _peer_contender(model: nn.Module, data, *, vocab: bool) -> Contender:
    import contextlib
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    peer = parallelize_llama(copy.deepcopy(model), tp_mesh, vocab=vocab)
    opt = _optimizer(list(peer.parameters()))
    loss_ctx = loss_parallel if vocab else contextlib.nullcontext

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        with loss_ctx():
            loss = lm_loss(peer(x), y)
            loss.backward()
        opt.step()
        return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()

    return Contender("DTensor " + ("blocks+vocab, loss_parallel" if vocab else "blocks"), step)


def _tp_line(summary: str) -> str:
    """The tensor-parallel line of autopar's plan summary (what it sharded)."""
    return next((line.strip() for line in summary.splitlines() if "tensor parallel" in line), "?")


def body(rank: int, world: int, variants: tuple, rounds: int, steps_per_round: int, warmup: int) -> list[dict]:
    """Every rank: for each variant build both contenders from the same weights and time them."""
    assert world == 2, "the tensor-parallel benchmark runs on 2 ranks"
    data = _data()
    model = _build_model()
    rows = []
    for variant in variants:
        ap, program = _autopar_contender(model, data, variant)
        peer = _peer_contender(model, data, vocab=VARIANTS[variant][1])
        mine, theirs = measure([ap, peer], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
        rows.append(dict(case=f"Llama 8x256 tp=2 {variant}", **row_cells(mine, theirs),
                         compile_s=program.compile_s, events=list(program.events),
                         tp_line=_tp_line(program.plan.summary())))
        del program
    return rows


def run(*, variants=("blocks", "blocks+vocab"), rounds: int = DEFAULTS["rounds"],
        steps_per_round: int = DEFAULTS["steps_per_round"], warmup: int = DEFAULTS["warmup"]) -> list[dict]:
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
        "Variants: `blocks` shards only those linears on both sides (autopar `vocab_parallel=False`); "
        "`blocks+vocab` is autopar's default plan (embedding, head and cross entropy sharded on the "
        "vocabulary) against the peer plus torchtitan's `embed_tokens` RowwiseParallel, `lm_head` "
        "ColwiseParallel with sharded logits and `loss_parallel()`; `auto` (optional) is autopar's fully "
        "automatic plan, microbatch count included. autopar runs 1 microbatch otherwise, as the peer.",
        "",
        markdown_table(rows),
        "",
        "autopar's plans: " + "; ".join(f"{r['case'].split()[-1]}: {r['tp_line']}" for r in rows) + ".",
        "",
        "autopar compile time (not in the step times): "
        + ", ".join(f"{r['autopar']} {r['compile_s']:.1f} s" for r in rows) + ".",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--variants", nargs="+", default=["blocks", "blocks+vocab"], choices=sorted(VARIANTS),
                        help="auto: autopar's automatic plan (it picks 2 microbatches even at pp=1)")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = run(variants=args.variants, rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup)
    print(console_table(rows))
    if not args.no_doc:
        update_section("tensor_parallel", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
