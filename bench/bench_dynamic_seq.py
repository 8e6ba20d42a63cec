"""A symbolic sequence dim against the same program compiled for one length, on that length (docs/batches.md).

A program compiled with ``dynamic_shapes='seq'`` runs graphs that read the sequence length at run
time (``aten.sym_size``) and receive pipeline edges shaped per microbatch; ``dynamic_shapes='static'``
bakes the example's length into every view. Both are compiled from the same weights on the same
mesh and trained alternately (tests' interleaved timing: ``_timing.measure``) on batches of the
example's length, so the ratio is the cost of keeping the length symbolic (goal: within 5%). A
third row times ``dynamic_shapes='auto'`` after a first batch of another length made it recapture
symbolic (on the fixed length it runs the compiled graphs, so the ratio shows the per-step lookup).

    python bench/bench_dynamic_seq.py                    # GPT 8x256, seq 128, pp=2 and dp=2; updates docs
    python bench/bench_dynamic_seq.py --tiny --no-doc    # a few seconds: proves it runs
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import console_table, markdown_table, run_note, stamped, update_section  # noqa: E402
from _spawn import spawn  # noqa: E402
from _timing import DEFAULTS, Contender, measure, row_cells  # noqa: E402

__all__ = ["run", "section", "main"]

MODEL = dict(name="gpt_tiny", num_layers=8, hidden=256, num_heads=8, seq_len=256)
TINY = dict(name="gpt_tiny", num_layers=2, hidden=32, num_heads=4, seq_len=32)
BATCH, SEQ, TINY_SEQ = 16, 128, 16
MESHES = {"pp=2": (1, 2, 1), "dp=2": (2, 1, 1)}


def _data(seq: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 128, (BATCH, seq), generator=g), torch.randint(0, 128, (BATCH, seq), generator=g))
            for _ in range(n)]


def _contender(name: str, model, data, mesh_shape, *, mode: str, warm_other: bool) -> tuple[Contender, float]:
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                              dynamic_shapes=mode, p2p_timeout_s=300)
    if warm_other:  # a shorter batch first: 'auto' recaptures with the length symbolic, 'static' compiles it alone
        x, y = data[0][0][:, :-8], data[0][1][:, :-8]
        program.train_step(program.shard_batch(x), target=program.shard_batch(y))
    compile_s = time.perf_counter() - t0

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender(name, step), compile_s


def body(rank: int, world: int, tiny: bool, meshes: tuple[str, ...], rounds: int, steps_per_round: int,
         warmup: int) -> list[dict]:
    from autopar.models import build_model
    spec = dict(TINY if tiny else MODEL)
    torch.manual_seed(0)
    model = build_model(spec.pop("name"), **spec)
    data = _data(TINY_SEQ if tiny else SEQ)
    rows = []
    for name in meshes:
        for mode in ("seq", "auto"):  # (both contenders take the same shorter first step before 'auto')
            fixed, fixed_s = _contender("static", model, data, MESHES[name], mode="static", warm_other=mode == "auto")
            dyn, dyn_s = _contender(mode, model, data, MESHES[name], mode=mode, warm_other=mode == "auto")
            mine, theirs = measure([dyn, fixed], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
            rows.append(dict(case=f"GPT {model.cfg.num_layers}x{model.cfg.hidden} {name}, seq {data[0][0].shape[1]}, "
                                  f"dynamic_shapes={mode} vs static", **row_cells(mine, theirs),
                             compile_s=f"{dyn_s:.1f} / {fixed_s:.1f}"))
    return rows


def run(*, tiny: bool = False, meshes=tuple(MESHES), rounds: int = DEFAULTS["rounds"],
        steps_per_round: int = DEFAULTS["steps_per_round"], warmup: int = DEFAULTS["warmup"]) -> list[dict]:
    """Spawn 2 gloo ranks, time the contenders, return rank 0's rows (stamped with date and load)."""
    return stamped(spawn, body, world_size=2, args=(tiny, tuple(meshes), rounds, steps_per_round, warmup),
                   timeout_s=1800)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    return "\n".join([
        "## A symbolic sequence dim vs a fixed length (`bench/bench_dynamic_seq.py`)",
        "",
        run_note(rows),
        "",
        f"Model: GPT, {MODEL['num_layers']} blocks, hidden {MODEL['hidden']}, {MODEL['num_heads']} heads; batch "
        f"{BATCH} of {SEQ} tokens, `lm_loss`, AdamW. Both programs from the same weights on the same mesh; "
        "'peer' is `dynamic_shapes='static'` (the length baked in), 'autopar' the symbolic one (`seq`), or "
        "`auto` after one shorter batch made it recapture symbolic. Goal: within 5%.",
        "",
        markdown_table(rows),
        "",
        "Compile seconds (symbolic / static; `auto` includes its recapture): "
        + ", ".join(f"{r['case']}: {r['compile_s']}" for r in rows) + ".",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-block model and 2 rounds: proves the script runs")
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=sorted(MESHES))
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rounds, warmup = (2, 1) if args.tiny else (args.rounds, args.warmup)
    rows = run(tiny=args.tiny, meshes=args.meshes, rounds=rounds, steps_per_round=args.steps_per_round,
               warmup=warmup)
    print(console_table(rows))
    if not args.no_doc and not args.tiny:
        update_section("dynamic_seq", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
