"""Pipeline parallelism: autopar pp=2 against ``torch.distributed.pipelining``, one run, 2 gloo ranks.

Both contenders train the same GPT (8 blocks, width 256, 8 heads, sequence 64, tied embedding
and head) on the same character batches (global batch 32, 4 microbatches unless told), with the same loss
(``lm_loss``) and optimizer (AdamW, lr 1e-3), split into two stages at the same block boundary:

- autopar: ``autopar.compile`` on a (dp=1, pp=2, tp=1) mesh with ``schedule=`` 1f1b / gpipe;
  its cost-based split (``program.plan.pipeline.stage_starts``) decides the boundary.
- peer: hand-written stage modules cut at that same boundary (embeddings + first blocks,
  last blocks + final norm + head), each wrapped in ``PipelineStage`` and driven by
  ``Schedule1F1B`` / ``ScheduleGPipe``. The tied embedding/head weight lives on both stages;
  its two gradients are summed with one all-reduce after the backward, as autopar does.

Both return the global mean loss on every rank (the peer broadcasts it from the last stage).

    python bench/bench_pipeline.py                 # ~1.5 min; prints a table, updates docs
    python bench/bench_pipeline.py --schedules 1f1b --rounds 4
    python bench/bench_pipeline.py --schedules 1f1b --microbatches 8 16   # per-action cost
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from _setup import adamw, seeded_model, text_batches
from _report import console_table, markdown_rows, markdown_table, run_note, stamped, update_section
from _spawn import spawn
from _timing import DEFAULTS, Contender, measure, row_cells

from autopar.runtime.execution.trace import gather_events, replay

__all__ = ["MODEL", "run", "section", "main"]

MODEL = dict(name="gpt_tiny", num_layers=8, hidden=256, num_heads=8, seq_len=64)
BATCH = 32
MICROBATCHES = (4, 8, 16)  # microbatch counts measured by default (global batch fixed)
NUM_BATCHES = 4
SEED = 0
PEER_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


_optimizer = adamw


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return text_batches(MODEL, batch=BATCH, seed=SEED, count=NUM_BATCHES)


def _build_model() -> nn.Module:
    return seeded_model(MODEL, seed=SEED)


class FirstStage(nn.Module):
    """Embeddings and blocks ``[0, split)`` of a GPT."""

    def __init__(self, gpt: nn.Module, split: int):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[:split])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """Blocks ``[split, L)``, final norm and (tied) head of a GPT."""

    def __init__(self, gpt: nn.Module, split: int):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[split:])
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _split_index(stage_starts: tuple[str, ...]) -> int:
    """The block index where autopar's second stage starts ("blocks.K" -> K)."""
    if len(stage_starts) != 1 or not stage_starts[0].startswith("blocks."):
        raise RuntimeError(f"autopar split the model at {stage_starts}; this benchmark mirrors "
                           "only a single split at a block boundary ('blocks.K')")
    return int(stage_starts[0].split(".")[1])


def _autopar_contender(model: nn.Module, data, schedule: str, microbatches: int) -> tuple[Contender, object]:
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=_optimizer, schedule=schedule,
                              num_microbatches=microbatches, p2p_timeout_s=120)
    program.compile_s = time.perf_counter() - t0

    program.step_events = []  # every step's action events (the list train_step made), for _floor

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        loss = program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()
        program.step_events.append(program.events)
        return loss

    return Contender(f"autopar {schedule}", step), program


def _floor(program, *, skip: int) -> float:
    """Median over the timed steps of the schedule's own step time: the simulator's replay of the step's
    actions with their measured durations and transfers that take no time (runtime/execution/trace.py ``replay``).

    An action's measured duration is its compute and the executor's own work for it, less its waits
    on the other rank; with free transfers, the replay's step is the shortest that this schedule
    allows for these actions on this split, before the optimizer step, gradient sync and loss are
    even counted. An executor that ran the same kernels faster per action could go below it; one
    that only cut waiting cannot.
    """
    floors = [replay(program.schedule, gather_events(program, events=events), p2p=0.0).step_time
              for events in program.step_events[skip:]]
    return statistics.median(floors)


def _peer_contender(model: nn.Module, data, schedule: str, split: int, rank: int, microbatches: int) -> Contender:
    from torch.distributed import pipelining
    from autopar.models import lm_loss
    gpt = copy.deepcopy(model)
    stage_mod = FirstStage(gpt, split) if rank == 0 else LastStage(gpt, split)
    tied = gpt.tok_emb.weight  # also gpt.lm_head.weight: one copy per stage, grads summed
    stage = pipelining.PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    sched = getattr(pipelining, PEER_SCHEDULES[schedule])(stage, microbatches, loss_fn=lm_loss)
    opt = _optimizer(list(stage_mod.parameters()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        grad = tied.grad if tied.grad is not None else torch.zeros_like(tied)
        dist.all_reduce(grad)
        tied.grad = grad
        opt.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=1)
        return loss.item()

    return Contender(f"torch {PEER_SCHEDULES[schedule]}", step)


def body(rank: int, world: int, schedules: tuple[str, ...], rounds: int, steps_per_round: int,
         warmup: int, microbatches: tuple[int, ...] = MICROBATCHES) -> list[dict]:
    """Every rank: for each schedule and microbatch count build both contenders from the same weights
    and time them."""
    assert world == 2, "the pipeline benchmark runs on 2 ranks"
    data = _data()
    model = _build_model()
    rows = []
    for schedule in schedules:
        for count in microbatches:
            ap, program = _autopar_contender(model, data, schedule, count)
            split = _split_index(program.plan.pipeline.stage_starts)
            peer = _peer_contender(model, data, schedule, split, rank, count)
            mine, theirs = measure([ap, peer], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
            rows.append(dict(case=f"GPT 8x256 pp=2 {schedule}, {count} mb of {BATCH // count}",
                             **row_cells(mine, theirs), compile_s=program.compile_s, events=list(program.events),
                             split=split, floor_s=_floor(program, skip=warmup)))
            del program
    return rows


def run(*, schedules=("1f1b", "gpipe"), rounds: int = DEFAULTS["rounds"],
        steps_per_round: int = DEFAULTS["steps_per_round"], warmup: int = DEFAULTS["warmup"],
        microbatches: tuple[int, ...] = MICROBATCHES) -> list[dict]:
    """Spawn 2 gloo ranks, run the benchmark, return rank 0's rows (stamped with date and load)."""
    return stamped(spawn, body, world_size=2,
                   args=(tuple(schedules), rounds, steps_per_round, warmup, tuple(microbatches)), timeout_s=1200)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    split = rows[0]["split"]
    return "\n".join([
        "## Pipeline parallelism: autopar pp=2 vs torch.distributed.pipelining",
        "",
        run_note(rows),
        "",
        f"Model: GPT, {MODEL['num_layers']} blocks, hidden {MODEL['hidden']}, {MODEL['num_heads']} heads, "
        f"sequence {MODEL['seq_len']}, vocab 128, tied embedding/head (6.37M parameters). "
        f"Global batch {BATCH} in the microbatches each row names, `lm_loss`, AdamW(lr=1e-3).",
        f"Both pipelines cut at `blocks.{split}` (autopar's cost-based choice, mirrored by the peer's "
        "hand-written stage modules); the peer sums the tied weight's two gradients with one all-reduce.",
        "",
        markdown_table(rows),
        "",
        "autopar compile time (capture, plan, split; not in the step times): "
        + ", ".join(f"{r['autopar']} {r['compile_s']:.1f} s" for r in rows) + ".",
        "",
        "How far below the peer a step can go (`_floor`): the schedule's own step time, the simulator's "
        "replay of each timed step's actions with their measured durations (compute and the executor's "
        "per-action work, less waits on the other rank) and transfers that take no time; the optimizer "
        "step, gradient sync and loss are not in it. Median over the timed steps:",
        "",
        markdown_rows(["case", "floor s/step", "peer s/step", "peer / floor", "0.95 x peer s/step"],
                      [[r["case"], f"{r['floor_s']:.3f}", f"{r['peer_s']:.3f}", f"{r['peer_s'] / r['floor_s']:.3f}",
                        f"{0.95 * r['peer_s']:.3f}"] for r in rows]),
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], choices=sorted(PEER_SCHEDULES))
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=list(MICROBATCHES),
                        help=f"microbatch counts to measure (each divides the global batch {BATCH})")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = run(schedules=args.schedules, rounds=args.rounds, steps_per_round=args.steps_per_round,
               warmup=args.warmup, microbatches=args.microbatches)
    print(console_table(rows))
    if not args.no_doc:
        update_section("pipeline", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
