"""The flight record's cost: the same program with and without it, alternated in one run.

Every rank keeps a flight record (its last actions, collectives and transfers, ops/flight_record.py),
a heartbeat thread writing to the rendezvous store once a second (runtime/diagnostics/flight_watch.py) and the
straggler figures riding on the step's existing all-reduce (runtime/diagnostics/stragglers.py). This benchmark
compiles one model twice in one 2-rank process group, ``flight_record=0`` (none of it) and the default
(all of it), and alternates their training steps (``_timing.measure``: short rounds, order flipped
each round, barrier-bracketed steps), for the meshes where the record writes the most entries per
step: pp=2 under 1F1B (an action, a send and a receive per microbatch) and tp=2 (an all-reduce per
block, forward and backward). The goal: a wall and CPU ratio with/without under 1.01.

    python bench/bench_flight_record.py            # a few minutes on 2 cores; updates docs/benchmarks.md
    python bench/bench_flight_record.py --tiny --rounds 2 --warmup 1 --no-doc   # proves it runs
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import console_table, markdown_table, run_note, stamped, update_section  # noqa: E402
from _setup import adamw, seeded_model, text_batches  # noqa: E402
from _spawn import spawn  # noqa: E402
from _timing import DEFAULTS, Contender, measure, row_cells  # noqa: E402

from autopar.runtime.diagnostics.flight_watch import HEARTBEAT_S  # noqa: E402

__all__ = ["run", "section", "main"]

MODEL = dict(name="gpt_tiny", num_layers=8, hidden=256, num_heads=8, seq_len=64)
TINY = dict(name="gpt_tiny", num_layers=2, hidden=64, num_heads=4, seq_len=16)
BATCH, NUM_BATCHES, SEED = 32, 4, 0
#: mesh (dp, pp, tp) -> compile options: where the record writes the most entries per step
MESHES = {"pp=2 1f1b": ((1, 2, 1), {"schedule": "1f1b", "num_microbatches": 8}),
          "tp=2": ((1, 1, 2), {"num_microbatches": 1})}


def _contender(model: nn.Module, data, mesh_name: str, *, flight_record: int, name: str) -> tuple[Contender, object]:
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    shape, options = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp"))
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=adamw, flight_record=flight_record, **options)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender(name, step), program


def body(rank: int, world: int, meshes: tuple, tiny: bool, rounds: int, steps_per_round: int,
         warmup: int) -> list[dict]:
    """Every rank: per mesh, the program with the flight record and without it, timed alternately."""
    config = TINY if tiny else MODEL
    data = text_batches(config, batch=BATCH, seed=SEED, count=NUM_BATCHES)
    model = seeded_model(config, seed=SEED)
    rows = []
    for mesh_name in meshes:
        on, program = _contender(model, data, mesh_name, flight_record=4096, name="with flight record")
        off, _ = _contender(model, data, mesh_name, flight_record=0, name="without")
        mine, theirs = measure([on, off], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
        per_step = program.flight.num_written / max(program.step_count, 1)
        direct = _direct_cost(program, entries_per_step=per_step, step_s=mine.median_s)
        rows.append(dict(case=f"GPT {config['num_layers']}x{config['hidden']} {mesh_name}", **row_cells(mine, theirs),
                         entries_per_step=per_step, **direct))
    return rows


def _direct_cost(program, *, entries_per_step: float, step_s: float, n: int = 20000, beats: int = 20) -> dict:
    """The record's cost counted directly rather than read off two noisy step times: the seconds of one
    entry (begin and end, as the executor writes an action; a collective's open, wait and end) in a record of
    the program's capacity, times the entries a step writes, plus one heartbeat's seconds (this rank's store
    calls) times the beats a step's length holds; as a share of the step."""
    from autopar.ops.flight_record import ACTION, FlightRecord
    record = FlightRecord(rank=0, capacity=program.flight.capacity)
    began = time.perf_counter()
    for i in range(n // 2):
        record.end(record.begin(ACTION, "0F0", stage=0, microbatch=i))
        entry = record.collective("all_reduce", "TpReduce node tp_reduce_0", (0, 1))
        record.waiting(entry)
        record.end(entry)
    entry_s = (time.perf_counter() - began) / n
    beat_s = 0.0
    if program.watch is not None:
        began = time.perf_counter()
        for _ in range(beats):
            program.watch.beat()
        beat_s = (time.perf_counter() - began) / beats
    per_step_s = entries_per_step * entry_s + beat_s * step_s / program.watch.heartbeat_s if program.watch else 0.0
    return dict(entry_us=entry_s * 1e6, beat_ms=beat_s * 1e3, direct_share=per_step_s / step_s)


def run(*, meshes=tuple(MESHES), tiny: bool = False, rounds: int = DEFAULTS["rounds"],
        steps_per_round: int = DEFAULTS["steps_per_round"], warmup: int = DEFAULTS["warmup"]) -> list[dict]:
    """Spawn 2 gloo ranks, run the benchmark, return rank 0's rows (stamped with date and load)."""
    return stamped(spawn, body, world_size=2, args=(tuple(meshes), tiny, rounds, steps_per_round, warmup),
                   timeout_s=1200)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    return "\n".join([
        "## The flight record's cost: with against without, one run",
        "",
        run_note(rows),
        "",
        f"Model: GPT {MODEL['num_layers']} layers, hidden {MODEL['hidden']}, sequence {MODEL['seq_len']}; batch "
        f"{BATCH}, AdamW. Both programs compiled from the same weights in one 2-rank group, steps alternated; "
        "\"with\" is the default (`flight_record=4096`: the record, the heartbeat thread, the straggler "
        "figures on the step's all-reduce), \"without\" is `flight_record=0`. Goal: ratios under 1.01.",
        "",
        markdown_table(rows),
        "",
        "Entries written per step: " + ", ".join(f"{r['case']} {r['entries_per_step']:.0f}" for r in rows) + ".",
        "",
        "Two alternated step times differ by a few percent from round to round here, more than the record can "
        "cost, so its cost is also counted directly on the same ranks: one entry (an action's begin and end, "
        "a collective's open, wait and end) timed over 20,000 entries, times the entries a step writes, plus "
        "one heartbeat (its store calls) times the beats a step's length holds:",
        "",
        "| case | seconds per entry | heartbeat | direct cost per step |",
        "|---|---|---|---|",
        *(f"| {r['case']} | {r['entry_us']:.2f} µs | {r['beat_ms']:.2f} ms per {HEARTBEAT_S:g} s | "
          f"{r['direct_share']:.3%} |" for r in rows),
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=sorted(MESHES))
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT of hidden 64: proves the script runs")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = run(meshes=args.meshes, tiny=args.tiny, rounds=args.rounds, steps_per_round=args.steps_per_round,
               warmup=args.warmup)
    print(console_table(rows))
    if not args.no_doc and not args.tiny:
        update_section("flight_record", section(rows))
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(0 if main() else 1)
