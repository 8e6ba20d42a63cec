"""Soak: does a long run hold steady? Resident memory and live tensor bytes per rank over a few hundred steps.

Each family trains a tiny model on 2 gloo ranks (its own spawned group, so one family's memory never
shows in the next) for ``--steps`` steps on a few character batches used in turn, and every
``--every`` steps reads, on every rank, the resident set size (``VmRSS`` of ``/proc/self/status``)
and the bytes and count of the storages of every live tensor the garbage collector finds
(``autopar.runtime.diagnostics.memory_probe.live_storages``). The growth from step ``--base`` (100) to the last
step is what a longer run would keep adding; the acceptance for issue 37 is under 2 MB of RSS per rank
from step 100 to 599 for every family.

torch's flight recorder (``TORCH_FR_BUFFER_SIZE``) keeps a record of each of the last 2,000 collectives
(about 1 KB each): with it on, RSS grows by about 2 MB until the ring is full (a few hundred to a
thousand steps here, two or three collectives a step), then stops. That is torch's, bounded, and would
hide what autopar keeps, so the ranks run with it off unless ``--flight-recorder N`` asks for N entries.

Families: the synchronous schedules (1F1B, GPipe, interleaved 1F1B), the split-backward ones (ZB-H1,
ZB-V), DualPipeV and Chimera on pp=2; PipeDream, PipeDream-2BW and PipeMare (asynchronous) on pp=2;
DDP and ZeRO-1/2/3 on dp=2; tp=2; ep=2 (a switch MoE on dp=2); and 1F1B on pp=2 saving a checkpoint
every ``--save-every`` steps.

    python bench/bench_soak.py --steps 600 --doc        # every family, ~60-90 min on 2 cores; writes the table
    python bench/bench_soak.py --steps 30 --every 10 --families 1f1b pipedream     # a smoke run
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from _report import markdown_rows, run_note, stamped, update_section
from _spawn import spawn

__all__ = ["FAMILIES", "run", "section", "main"]

MB = 2**20
BATCH, SEQ, NUM_BATCHES, SEED = 8, 32, 4, 0
_PP, _DP, _TP = (1, 2, 1), (2, 1, 1), (1, 1, 2)
#: family -> (model, mesh (dp, pp, tp), compile options)
FAMILIES = {
    "1f1b": ("gpt_tiny", _PP, dict(schedule="1f1b", num_microbatches=4)),
    "gpipe": ("gpt_tiny", _PP, dict(schedule="gpipe", num_microbatches=4)),
    "interleaved_1f1b": ("gpt_tiny", _PP, dict(schedule="interleaved_1f1b", num_microbatches=4)),
    "zb_h1": ("gpt_tiny", _PP, dict(schedule="zb_h1", num_microbatches=4)),
    "zb_v": ("gpt_tiny", _PP, dict(schedule="zb_v", num_microbatches=4)),
    "dualpipev": ("gpt_tiny", _PP, dict(schedule="dualpipev", num_microbatches=4)),
    "chimera": ("gpt_tiny", _PP, dict(schedule="chimera", num_microbatches=4)),
    "pipedream": ("llama_tiny", _PP, dict(schedule="pipedream", num_microbatches=4)),
    "pipedream_2bw": ("gpt_tiny", _PP, dict(schedule="pipedream_2bw", num_microbatches=4)),
    "pipemare": ("llama_tiny", _PP, dict(schedule="pipemare", num_microbatches=4)),
    "ddp": ("gpt_tiny", _DP, dict(zero_stage=0)),
    "zero1": ("gpt_tiny", _DP, dict(zero_stage=1)),
    "zero2": ("gpt_tiny", _DP, dict(zero_stage=2)),
    "zero3": ("gpt_tiny", _DP, dict(zero_stage=3)),
    "tp": ("gpt_tiny", _TP, {}),
    "ep": ("switch", _DP, dict(expert_parallel=2)),
    "checkpoint": ("gpt_tiny", _PP, dict(schedule="1f1b", num_microbatches=4)),  # saves every --save-every steps
}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def _compile(name: str, mesh):
    """(program, batches) of family ``name`` on this rank."""
    import autopar
    model_name, _, options = FAMILIES[name]
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    if model_name == "switch":
        from autopar.models.moe import build_moe, moe_loss
        model, loss_fn, vocab = build_moe("switch", seq_len=SEQ), moe_loss, 64
    else:
        from autopar.models import build_model, lm_loss
        model, loss_fn = build_model(model_name, seq_len=SEQ, num_layers=4), lm_loss
        vocab = model.cfg.vocab_size
    data = [(torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g))
            for _ in range(NUM_BATCHES)]
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=loss_fn, example_target=data[0][1],
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), **options)
    return program, data


def _body(rank: int, world: int, name: str, steps: int, every: int, save_every: int) -> list[dict]:
    """Train family ``name``; every rank's readings [{rank, step, rss, tensor_bytes, storages}]."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.diagnostics.memory_probe import live_storages

    mesh = init_device_mesh("cpu", FAMILIES[name][1], mesh_dim_names=("dp", "pp", "tp"))
    program, data = _compile(name, mesh)
    root = [tempfile.mkdtemp(prefix="autopar_soak_") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    readings = []
    live_storages()  # the census's own first allocations happen before the first reading
    try:
        for step in range(1, steps + 1):
            x, y = data[step % len(data)]
            program.train_step(program.shard_batch(x), target=program.shard_batch(y))
            if name == "checkpoint" and step % save_every == 0:
                program.save_checkpoint(os.path.join(root[0], "ckpt"))
            if step % every == 0 or step == steps:
                # RSS after the census: the census lists every object the collector tracks (about 1.6 MB of
                # pointers here), and the heap keeps that high-water mark; read before it, the first reading
                # misses the census's own pages and every later one holds them (a 2 MB step at the second
                # reading, flat after it). After it, every reading holds the same census.
                live = live_storages()
                rss = _rss_bytes()
                readings.append(dict(rank=rank, step=step, rss=rss, tensor_bytes=live.nbytes, storages=live.count))
        program.flush()  # an asynchronous pipeline's last backwards and sends
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, readings)
    return [r for part in every_rank for r in part]


def run(*, families: list[str], steps: int, every: int, base: int, save_every: int) -> list[dict]:
    """One row per (family, rank): its readings and the growth from step ``base`` (or the first reading) to the last."""
    rows = []
    for name in families:
        readings = spawn(_body, world_size=2, args=(name, steps, every, save_every), timeout_s=3600)
        for rank in sorted({r["rank"] for r in readings}):
            mine = [r for r in readings if r["rank"] == rank]
            first = next((r for r in mine if r["step"] >= base), mine[0])
            last = mine[-1]
            rows.append(dict(family=name, rank=rank, readings=mine, base_step=first["step"], last_step=last["step"],
                             rss_growth=last["rss"] - first["rss"],
                             tensor_growth=last["tensor_bytes"] - first["tensor_bytes"],
                             storage_growth=last["storages"] - first["storages"]))
        print(table([r for r in rows if r["family"] == name]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table: per family and rank, RSS and live tensor MB at each reading, and the growth."""
    steps = [r["step"] for r in rows[0]["readings"]]
    header = ["family", "rank"] + [f"RSS MB @{s}" for s in steps] + [
        "live tensors MB (first / last)", "RSS growth MB", "tensor growth bytes (storages)"]
    body = []
    for row in rows:
        readings = row["readings"]
        body.append([row["family"], str(row["rank"])] + [f"{r['rss'] / MB:.1f}" for r in readings] + [
            f"{readings[0]['tensor_bytes'] / MB:.2f} / {readings[-1]['tensor_bytes'] / MB:.2f}",
            f"{row['rss_growth'] / MB:+.2f} (@{row['base_step']} -> @{row['last_step']})",
            f"{row['tensor_growth']:+d} ({row['storage_growth']:+d})"])
    return markdown_rows(header, body)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    worst = max(rows, key=lambda r: r["rss_growth"])
    return "\n".join([
        "## Soak: resident memory over a long run (issue 37)",
        "",
        run_note(rows),
        "",
        f"Tiny models (gpt_tiny, llama_tiny for PipeDream and PipeMare, the switch MoE for ep; 4 blocks, sequence "
        f"{SEQ}, batch {BATCH}, AdamW), 2 ranks, each family in its own process group (`python bench/bench_soak.py "
        f"--steps {rows[0]['last_step']} --doc`). Resident set size (VmRSS) and the bytes of every live tensor's "
        "storage (found through the garbage collector) per rank at each reading, RSS read right after that census "
        "(which lists every tracked object, about 1.6 MB of pointers, so every reading holds the same census); "
        "growth from the first reading at "
        "or after step 100 to the last. Acceptance: under 2 MB of RSS per rank from step 100 to 599 for every "
        f"family. Largest growth: {worst['family']} rank {worst['rank']}, {worst['rss_growth'] / MB:+.2f} MB. "
        f"torch's flight recorder: {os.environ.get('TORCH_FR_BUFFER_SIZE', '2000')} entries (on, its 2,000 "
        "entries of about 1 KB fill over the first few hundred to thousand steps: about 2 MB more, then flat).",
        "",
        table(rows),
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100, help="steps between readings")
    parser.add_argument("--base", type=int, default=100, help="the growth is measured from this step on")
    parser.add_argument("--save-every", type=int, default=10, help="the checkpoint family saves this often")
    parser.add_argument("--flight-recorder", type=int, default=0, metavar="N",
                        help="entries of torch's flight recorder on the ranks (TORCH_FR_BUFFER_SIZE; torch: 2000)")
    parser.add_argument("--doc", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.flight_recorder)  # the spawned ranks inherit it
    rows = stamped(run, families=args.families, steps=args.steps, every=args.every, base=args.base,
                   save_every=args.save_every)
    over = [r for r in rows if r["rss_growth"] >= 2 * MB]
    print("\n" + (f"RSS grew by 2 MB or more: {[(r['family'], r['rank']) for r in over]}" if over
                  else "every family and rank: RSS growth under 2 MB"))
    if args.doc:
        update_section("soak", section(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
