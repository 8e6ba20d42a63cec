"""The planner's pick against the fastest hand-configured torch peer, on 2 and 4 gloo ranks.

One run per world size, one process group; every contender trains its own copy of the same
Llama (the tensor-parallel benchmark's model: 8 layers, hidden 256, 8 heads, SwiGLU 704,
sequence 64, vocab 128, untied head) on the same character batches (global batch 32) with
``lm_loss`` and AdamW(lr=1e-3):

- autopar: ``autopar.compile(model, None, plan="auto")``: the planner chooses dp, pp, tp, the
  schedule and the microbatches for this machine and builds the mesh;
- torch DDP over every rank (one forward/backward per step);
- torch pipelining ``Schedule1F1B`` over every rank, the layers cut by hand into equal runs
  (embedding on the first stage, norm and head on the last), ``2 x ranks`` microbatches;
- DTensor tensor parallelism over every rank, torchtitan's recipe
  (:func:`bench_tensor_parallel.parallelize_llama`, vocabulary too, ``loss_parallel()``).

Each torch peer is what a user who picks the strategy by hand would write. The table gives each
peer's step time, and autopar's pick against the fastest of them (a ratio in one run, contenders
alternating in rounds, ``bench/_timing.py``); the losses of every contender are printed side by
side (equal training: equal losses to fp32 rounding).

    python bench/bench_planner_pick.py              # ~4 min; prints a table, updates docs/benchmarks.md
    python bench/bench_planner_pick.py --worlds 2 --rounds 4
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from _report import markdown_table, run_note, stamped, update_section
from _setup import adamw, seeded_model, text_batches
from _spawn import spawn
from _timing import DEFAULTS, Contender, measure, row_cells
from bench_tensor_parallel import MODEL, parallelize_llama

__all__ = ["run", "section", "main"]

BATCH = 32
NUM_BATCHES = 4
SEED = 0
_optimizer = adamw


def _autopar(model: nn.Module, data) -> tuple[Contender, object]:
    import autopar
    from autopar.models import lm_loss
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), None, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=_optimizer, plan="auto", p2p_timeout_s=120)
    program.compile_s = time.perf_counter() - t0

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender("autopar plan='auto'", step), program


def _ddp(model: nn.Module, data, rank: int, world: int) -> Contender:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from autopar.models import lm_loss
    module = DDP(copy.deepcopy(model))
    opt = _optimizer(module.parameters())
    local = BATCH // world

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(module(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local])
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        return reduced.item() / world

    return Contender(f"torch DDP dp={world}", step)


class LlamaStage(nn.Module):
    """Layers ``[start, end)`` of a Llama, with the embedding on the first stage and norm + head on the last."""

    def __init__(self, llama: nn.Module, start: int, end: int):
        super().__init__()
        last = end == len(llama.layers)
        self.embed_tokens = llama.embed_tokens if start == 0 else None
        self.layers = nn.ModuleList(llama.layers[start:end])
        self.norm, self.lm_head = (llama.norm, llama.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def _pipelining(model: nn.Module, data, rank: int, world: int) -> Contender:
    from torch.distributed import pipelining
    from autopar.models import lm_loss
    llama = copy.deepcopy(model)
    per = len(llama.layers) // world
    stage_mod = LlamaStage(llama, rank * per, (rank + 1) * per if rank < world - 1 else len(llama.layers))
    stage = pipelining.PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    microbatches = 2 * world
    sched = pipelining.Schedule1F1B(stage, microbatches, loss_fn=lm_loss)
    opt = _optimizer(list(stage_mod.parameters()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, return_outputs=False)
        elif rank == world - 1:
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        opt.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=world - 1)
        return loss.item()

    return Contender(f"torch Schedule1F1B pp={world} ({microbatches} mb)", step)


def _dtensor(model: nn.Module, data, world: int) -> Contender:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from autopar.models import lm_loss
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    peer = parallelize_llama(copy.deepcopy(model), tp_mesh, vocab=True)
    opt = _optimizer(list(peer.parameters()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        with loss_parallel():
            loss = lm_loss(peer(x), y)
            loss.backward()
        opt.step()
        return loss.full_tensor().item()

    return Contender(f"DTensor tp={world} (blocks+vocab)", step)


def body(rank: int, world: int, rounds: int, steps_per_round: int, warmup: int) -> list[dict]:
    """Every rank: the planner's program and the three hand-configured peers, timed in alternating rounds."""
    data = text_batches(MODEL, batch=BATCH, seed=SEED, count=NUM_BATCHES)
    model = seeded_model(MODEL, seed=SEED)
    mine, program = _autopar(model, data)
    peers = [_ddp(model, data, rank, world), _pipelining(model, data, rank, world), _dtensor(model, data, world)]
    timings = measure([mine, *peers], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
    fastest = min(timings[1:], key=lambda t: t.median_s)
    m = program.plan.mesh
    pick = (f"dp={m.dp} pp={m.pp} tp={m.tp}, {program.plan.pipeline.schedule}, "
            f"{program.plan.pipeline.num_microbatches} mb")
    return [dict(case=f"Llama 8x256, {world} ranks: pick {pick}", **row_cells(timings[0], fastest),
                 peers={t.name: t.median_s for t in timings[1:]},
                 losses={t.name: (t.first_loss, t.last_loss) for t in timings},
                 compile_s=program.compile_s, world=world)]


def run(*, worlds=(2, 4), rounds: int = DEFAULTS["rounds"], steps_per_round: int = DEFAULTS["steps_per_round"],
        warmup: int = DEFAULTS["warmup"]) -> list[dict]:
    """One spawned group per world size; rank 0's rows, stamped with date and load."""
    rows = []
    for world in worlds:
        rows += stamped(spawn, body, world_size=world, args=(rounds, steps_per_round, warmup), timeout_s=900)
    return rows


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    peers = "; ".join(f"{r['world']} ranks: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["peers"].items())
                      for r in rows)
    losses = "; ".join(f"{r['world']} ranks: " + ", ".join(f"{k} {a:.5f}->{b:.5f}" for k, (a, b) in r["losses"].items())
                       for r in rows)
    return "\n".join([
        "## The planner's pick vs the fastest hand-configured torch peer",
        "",
        run_note(rows),
        "",
        f"Model: Llama-style, {MODEL['num_layers']} layers, hidden {MODEL['hidden']}, {MODEL['num_heads']} heads, "
        f"sequence {MODEL['seq_len']}, vocab 128; batch {BATCH}, `lm_loss`, AdamW(lr=1e-3). autopar: "
        "`compile(model, None, plan=\"auto\")`; peers: torch DDP over every rank, `Schedule1F1B` over every rank "
        "with the layers cut by hand into equal runs and 2 x ranks microbatches, DTensor TP over every rank "
        "(torchtitan's recipe with the vocabulary and `loss_parallel()`). The ratio is autopar's pick over the "
        "fastest peer of the same run.",
        "",
        markdown_table(rows),
        "",
        f"Every peer's median step: {peers}.",
        "",
        f"Losses (first -> last step): {losses}.",
        "",
        "autopar compile time, planning included (not in the step times): "
        + ", ".join(f"{r['world']} ranks {r['compile_s']:.1f} s" for r in rows) + ".",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = run(worlds=tuple(args.worlds), rounds=args.rounds, steps_per_round=args.steps_per_round,
               warmup=args.warmup)
    for r in rows:
        print(f"{r['case']}: {r['ratio']:.3f} x {r['peer']} (rounds {r['round_iqr']}); peers {r['peers']}")
    if not args.no_doc:
        update_section("planner_pick", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
