"""Sequence parallelism: autopar tp=2 with ``sequence_parallel=True`` against DTensor's SP recipe, one run.

Both contenders train the Llama-style model of ``bench_tensor_parallel`` (8 layers, width 256,
8 heads, SwiGLU 704, sequence 64, batch 32, ``lm_loss``, AdamW(lr=1e-3)) on 2 gloo ranks:

- autopar: ``autopar.compile(..., sequence_parallel=True, num_microbatches=1)`` (vocabulary-
  parallel embedding, head and loss as by default).
- peer: torchtitan's recipe: per layer ``SequenceParallel`` on both norms, ``PrepareModuleInput``
  (sequence shard -> replicated) before attention and MLP, ColwiseParallel on q/k/v/gate/up,
  RowwiseParallel(output_layouts=Shard(1)) on o/down; the embedding RowwiseParallel with a
  sequence-sharded output, the final norm SequenceParallel, the head ColwiseParallel from a
  sequence shard with sharded logits, and ``loss_parallel()``.

Besides step time, each rank's activation memory (bytes autograd saves in one forward, weights
left out) is reported for autopar with and without sequence parallelism.

    python bench/bench_sequence_parallel.py          # ~2 min; prints a table, updates docs
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

__all__ = ["MODEL", "parallelize_llama_sp", "saved_activation_bytes", "run", "section", "main"]

MODEL = dict(name="llama_tiny", num_layers=8, hidden=256, num_heads=8, num_kv_heads=8,
             intermediate=704, seq_len=64)
BATCH = 32
NUM_BATCHES = 4
SEED = 0


_optimizer = adamw


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return text_batches(MODEL, batch=BATCH, seed=SEED, count=NUM_BATCHES)


def _build_model() -> nn.Module:
    return seeded_model(MODEL, seed=SEED)


def saved_activation_bytes(fn, weights) -> int:
    """Bytes of the distinct activations autograd saves while ``fn()`` runs (``weights``' storages left out)."""
    skip = {w.untyped_storage().data_ptr() for w in weights}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if t.is_floating_point() and s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _autopar(model, data, *, sequence_parallel: bool):
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=_optimizer, num_microbatches=1,
                              sequence_parallel=sequence_parallel)
    compile_s = time.perf_counter() - t0
    (stage,) = program.stages.values()
    x, y = data[0]
    memory = saved_activation_bytes(lambda: stage.gm(x, y), list(stage.gm.parameters()) + list(stage.gm.buffers()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender("autopar tp=2 " + ("SP" if sequence_parallel else "no SP"), step), compile_s, memory


def parallelize_llama_sp(model: nn.Module, tp_mesh) -> nn.Module:
    """torchtitan's tensor + sequence parallel plan for the Llama of autopar.models (head counts per rank)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    tp = tp_mesh.size()
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        attn = layer.attn
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        attn.hidden //= tp
    return model


def _peer(model, data) -> Contender:
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    peer = parallelize_llama_sp(copy.deepcopy(model), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    opt = _optimizer(list(peer.parameters()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        with loss_parallel():
            loss = lm_loss(peer(x), y)
            loss.backward()
        opt.step()
        return loss.full_tensor().item()

    return Contender("DTensor tp=2 SP, loss_parallel", step)


def body(rank: int, world: int, rounds: int, steps_per_round: int, warmup: int) -> list[dict]:
    """Every rank: build both contenders from the same weights, time them interleaved; memory of autopar."""
    assert world == 2, "the sequence-parallel benchmark runs on 2 ranks"
    data, model = _data(), _build_model()
    _, _, memory_tp = _autopar(model, data, sequence_parallel=False)
    ap, compile_s, memory_sp = _autopar(model, data, sequence_parallel=True)
    mine, theirs = measure([ap, _peer(model, data)], rounds=rounds, steps_per_round=steps_per_round,
                           warmup=warmup)
    return [dict(case="Llama 8x256 tp=2 sequence parallel", **row_cells(mine, theirs), compile_s=compile_s,
                 memory_tp=memory_tp, memory_sp=memory_sp)]


def run(*, rounds: int = DEFAULTS["rounds"], steps_per_round: int = DEFAULTS["steps_per_round"],
        warmup: int = DEFAULTS["warmup"]) -> list[dict]:
    """Spawn 2 gloo ranks, run the benchmark, return rank 0's rows (stamped with date and load)."""
    return stamped(spawn, body, world_size=2, args=(rounds, steps_per_round, warmup), timeout_s=900)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    r = rows[0]
    return "\n".join([
        "## Sequence parallelism: autopar tp=2 SP vs DTensor's sequence-parallel plan",
        "",
        run_note(rows),
        "",
        f"Model and data as in the tensor-parallel benchmark (Llama-style, {MODEL['num_layers']} layers, hidden "
        f"{MODEL['hidden']}, sequence {MODEL['seq_len']}, batch {BATCH}, AdamW). Peer: torchtitan's plan "
        "(SequenceParallel norms, PrepareModuleInput before attention and MLP, RowwiseParallel to a sequence "
        "shard, sequence-sharded embedding output, head from a sequence shard, `loss_parallel()`). Both run "
        "1 microbatch.",
        "",
        markdown_table(rows),
        "",
        f"autopar activation memory per rank (bytes saved for backward in one forward, weights left out): "
        f"{r['memory_tp'] / 2**20:.2f} MiB without sequence parallelism, {r['memory_sp'] / 2**20:.2f} MiB with it "
        f"({r['memory_sp'] / r['memory_tp']:.2f}x). autopar compile time {r['compile_s']:.1f} s (not in the step times).",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = run(rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup)
    print(console_table(rows))
    r = rows[0]
    print(f"activation memory per rank: no SP {r['memory_tp']} B, SP {r['memory_sp']} B")
    if not args.no_doc:
        update_section("sequence_parallel", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
