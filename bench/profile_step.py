"""Where a step's time goes: cProfile of autopar and its peer, same benchmark setup, every rank.

Builds the contenders exactly as ``bench_pipeline`` / ``bench_schedules`` / ``bench_tensor_parallel`` do, warms them up,
then profiles ``--steps`` steps of each (alternating) with cProfile on every rank, and prints,
per rank and contender, the functions with the most own time and the most cumulative time.
For autopar it also prints the per-action timeline of the last step (``program.events``).

    python bench/profile_step.py pipeline --schedule 1f1b --microbatches 8
    python bench/profile_step.py schedules --schedule zb_v
    python bench/profile_step.py tensor_parallel --variant blocks
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch.distributed as dist

from _spawn import spawn
from _timing import Contender

__all__ = ["main"]


def _contenders(bench: str, schedule: str, variant: str, rank: int, microbatches: int):
    if bench == "schedules":
        import bench_schedules as b
        data, model = b._data(), b._build_model()
        ap, program = b._autopar(model, data, schedule)
        return [ap, b._peer(model, data, schedule, program, rank)], program
    if bench == "pipeline":
        import bench_pipeline as b
        data, model = b._data(), b._build_model()
        ap, program = b._autopar_contender(model, data, schedule, microbatches)
        split = int(program.plan.pipeline.stage_starts[0].split(".")[1])
        return [ap, b._peer_contender(model, data, schedule, split, rank, microbatches)], program
    import bench_tensor_parallel as b
    data, model = b._data(), b._build_model()
    ap, program = b._autopar_contender(model, data, variant)
    return [ap, b._peer_contender(model, data, vocab=b.VARIANTS[variant][1])], program


def _stats_text(prof: cProfile.Profile, *, steps: int, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"--- by own time (tottime), {steps} steps\n")
    stats.sort_stats("tottime").print_stats(top)
    out.write(f"--- by cumulative time, {steps} steps\n")
    stats.sort_stats("cumulative").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def body(rank: int, world: int, bench: str, schedule: str, variant: str, steps: int, warmup: int,
         top: int, microbatches: int = 4) -> str:
    """Every rank profiles its share; the texts are gathered to rank 0."""
    contenders, program = _contenders(bench, schedule, variant, rank, microbatches)
    for c in contenders:
        for _ in range(warmup):
            c.run()
    profiles = {c.name: cProfile.Profile() for c in contenders}
    for i in range(steps):
        for c in (contenders if i % 2 == 0 else contenders[::-1]):
            profiles[c.name].enable()
            c.run()
            profiles[c.name].disable()
    texts = [f"==== rank {rank}: {name}\n{_stats_text(p, steps=steps, top=top)}" for name, p in profiles.items()]
    events = "\n".join(f"  {a:>10s} {s * 1e3:8.1f} -> {e * 1e3:8.1f} ms" for a, s, e in program.events)
    texts.append(f"==== rank {rank}: autopar action timeline of the last step\n{events}")
    gathered = [None] * world
    dist.all_gather_object(gathered, "\n\n".join(texts))
    return "\n\n".join(gathered)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=["pipeline", "schedules", "tensor_parallel"])
    parser.add_argument("--schedule", default="1f1b",
                        help="pipeline: 1f1b or gpipe; schedules: any of bench_schedules.PEERS")
    parser.add_argument("--variant", default="blocks+vocab", choices=["blocks", "blocks+vocab", "auto"],
                        help="tensor_parallel only")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline only: microbatches per step")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(spawn(body, world_size=2, args=(args.bench, args.schedule, args.variant, args.steps,
                                                args.warmup, args.top, args.microbatches)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
