"""Context parallelism against data parallelism on the same tokens, and against one rank (docs/context_parallel.md).

A Llama with grouped-query attention at a long sequence, on N = 2 and N = 4 gloo ranks:

- **cp=N** (the sequence of every row cut over the N ranks, ring or all-to-all attention) against **dp=N**
  (whole rows, one per rank) on the same global batch of N rows: the same tokens per step and per rank. Both
  programs come from the same weights and are trained alternately in one process group (``_timing.measure``).
- **one rank**: the same global batch on a single process (its own spawned group, timed alone), for the
  speed-up each gives.
- **saved activations** per rank (the saved-tensor probe, ``runtime/diagnostics/memory_probe.py``, first step).
- **the longest sequence** one row may have within the activation bytes one rank saves for one row at the
  benchmark's length, by the memory calculator (``autopar.memory.estimate_memory``) bisecting on the length:
  dp trains one whole row per rank, cp cuts it over N.

On CPU the N ranks share 2 cores, so the ratio of cp to dp is the comparison this machine can make (goal: within
1.1x); torch's own ``context_parallel`` does not run on CPU in torch 2.13 (bench/gpu_check.sh has the GPU side).

    python bench/bench_cp.py                    # ~10 min on a quiet machine; updates docs/benchmarks.md
    python bench/bench_cp.py --tiny --no-doc    # seconds: proves it runs
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import console_table, markdown_rows, markdown_table, run_note, stamped, update_section  # noqa: E402
from _spawn import spawn  # noqa: E402
from _timing import Contender, measure, row_cells  # noqa: E402

__all__ = ["run", "longest", "section", "main"]

MODEL = dict(name="llama_tiny", num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, intermediate=352,
             seq_len=1024)
TINY = dict(name="llama_tiny", num_layers=1, hidden=32, num_heads=4, num_kv_heads=2, intermediate=64, seq_len=64)
STRATEGIES = ("ring", "all_to_all")


def _model(tiny: bool, seq_len: int | None = None):
    """The benchmark's Llama (``seq_len``: the longest sequence its position table takes; the benchmark's)."""
    from autopar.models import build_model
    spec = dict(TINY if tiny else MODEL)
    spec["seq_len"] = seq_len or spec["seq_len"]
    torch.manual_seed(0)
    return build_model(spec.pop("name"), **spec)


def _data(rows: int, seq: int, vocab: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g))
            for _ in range(n)]


def _program(model, data, shape: dict, **options):
    """One microbatch per step everywhere (the default takes two where a rank's rows divide by two: cp's N rows
    would run as two microbatches of one row each against dp's one row, twice the ops for the same tokens)."""
    import autopar
    from autopar.models import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    names = tuple(a for a in ("dp", "cp") if shape.get(a, 1) > 1) or ("dp",)
    mesh = init_device_mesh("cpu", tuple(shape.get(a, 1) for a in names), mesh_dim_names=names)
    return autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                           example_target=data[0][1], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                           p2p_timeout_s=600, num_microbatches=1, **options)


def _contender(name: str, program, data) -> tuple[Contender, int]:
    """A timed step, and the bytes this rank saved for backward in the first step (the probe)."""
    from autopar.runtime.diagnostics.memory_probe import recording_activations

    x, y = data[0]
    with recording_activations(program) as seen:
        program.train_step(program.shard_batch(x), target=program.shard_batch(y))
    saved = sum(seen.values())

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender(name, step), saved


def body(rank: int, world: int, tiny: bool, rounds: int, warmup: int, rows: int) -> dict:
    import torch.distributed as dist
    model = _model(tiny)
    data = _data(rows, model.cfg.seq_len, model.cfg.vocab_size)
    if world == 1:  # one rank: the whole global batch, timed alone
        program = _program(model, data, {"dp": 1})
        one, saved = _contender("one rank", program, data)
        (timing,) = measure([one], rounds=rounds, steps_per_round=1, warmup=warmup)
        return {"one_s": timing.median_s, "one_saved": saved, "one_loss": timing.first_loss}
    dp, dp_saved = _contender(f"dp={world}", _program(model, data, {"dp": world}), data)
    rows, saved = [], {f"dp={world}": dp_saved}
    for strategy in STRATEGIES:
        cp, cp_saved = _contender(f"cp={world} ({strategy})",
                                  _program(model, data, {"cp": world}, cp_strategy=strategy), data)
        mine, theirs = measure([cp, dp], rounds=rounds, steps_per_round=1, warmup=warmup)
        rows.append(dict(case=f"Llama {model.cfg.num_layers}x{model.cfg.hidden}, {world} rows of "
                              f"{model.cfg.seq_len}: {cp.name} vs {dp.name}", **row_cells(mine, theirs),
                         cp_s=mine.median_s, dp_s=theirs.median_s))
        saved[cp.name] = cp_saved
    every = [None] * world
    dist.all_gather_object(every, saved)  # every rank's saved bytes: the largest per configuration
    return {"rows": rows, "saved": {k: max(s[k] for s in every) for k in saved}}


def longest(cp: int, *, tiny: bool, budget: int, strategy: str = "ring") -> int:
    """The longest sequence of one row whose per-rank saved activations (the calculator) fit ``budget`` bytes,
    on ``cp`` ranks (1: one rank, the whole row), bisecting over multiples of 2 x cp."""
    import autopar
    from autopar.memory import estimate_memory
    from autopar.models import lm_loss

    model = _model(tiny, seq_len=64 * (TINY if tiny else MODEL)["seq_len"])  # (positions far past the budget)
    step = 2 * cp

    def saved(length: int) -> int:
        x = torch.zeros((1, length), dtype=torch.long)
        options = {"cp_strategy": strategy} if cp > 1 else {}
        result = autopar.plan(model, {"dp": 1, "cp": cp}, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                              dynamic_shapes="static", **options)
        return max(r.activations for r in estimate_memory(result, optimizer="adamw").ranks.values())

    low, high = step, step
    while saved(high) <= budget:
        low, high = high, high * 2
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if saved(mid) <= budget else (low, mid)
    return low


def run(*, tiny: bool = False, worlds=(2, 4), rounds: int = 8, warmup: int = 2) -> dict:
    """Every world's group, the one-rank runs and the longest sequences; rows stamped with date and load."""
    out = {"worlds": {}, "one": {}, "longest": {}}

    def groups():
        rows = []
        for world in worlds:
            out["one"][world] = spawn(body, world_size=1, args=(tiny, rounds, warmup, world), timeout_s=3600)
            out["worlds"][world] = spawn(body, world_size=world, args=(tiny, rounds, warmup, world), timeout_s=3600)
            for r in out["worlds"][world]["rows"]:
                r["one_s"] = out["one"][world]["one_s"]
                rows.append(r)
        return rows

    out["rows"] = stamped(groups)
    seq = (TINY if tiny else MODEL)["seq_len"]
    budget = _one_row_budget(tiny, seq)
    out["budget"] = budget
    for cp in (1, *worlds):
        out["longest"][cp] = longest(cp, tiny=tiny, budget=budget)
    return out


def _one_row_budget(tiny: bool, seq: int) -> int:
    """The calculator's per-rank saved bytes of one row of ``seq`` tokens on one rank (dp's per-rank load)."""
    import autopar
    from autopar.memory import estimate_memory
    from autopar.models import lm_loss
    x = torch.zeros((1, seq), dtype=torch.long)
    result = autopar.plan(_model(tiny), {"dp": 1}, example_inputs=(x,), loss_fn=lm_loss, example_target=x)
    return estimate_memory(result, optimizer="adamw").ranks[0].activations


def section(out: dict) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    rows = out["rows"]
    mib = 2 ** 20
    saved = [[f"N={w}", f"{out['one'][w]['one_saved'] / mib:.1f}",
              *(f"{v / mib:.1f}" for v in out["worlds"][w]["saved"].values())] for w in out["worlds"]]
    names = list(next(iter(out["worlds"].values()))["saved"])
    speed = [[r["case"], f"{r['one_s']:.3f}", f"{r['one_s'] / r['cp_s']:.2f}x", f"{r['one_s'] / r['dp_s']:.2f}x"]
             for r in rows]
    longest_rows = [["one rank (or dp, one row per rank)" if cp == 1 else f"cp={cp} (ring)",
                     f"{out['longest'][cp]:,}"] for cp in out["longest"]]
    return "\n".join([
        "## Context parallelism: cp=N vs dp=N on the same tokens, and one rank (`bench/bench_cp.py`)", "",
        run_note(rows), "",
        f"Model: Llama (`llama_tiny`), {MODEL['num_layers']} blocks, hidden {MODEL['hidden']}, {MODEL['num_heads']} "
        f"heads over {MODEL['num_kv_heads']} kv heads; N rows of {MODEL['seq_len']} tokens per step, `lm_loss`, "
        "AdamW. 'autopar' is cp=N (each row's sequence cut over the N ranks, load-balanced), 'peer' dp=N (one whole "
        "row per rank): the same tokens per rank. The N ranks share this machine's 2 cores. Goal: cp within 1.1x "
        "of dp.", "",
        markdown_table(rows), "",
        "Against one rank (the N rows on one process, timed alone in its own run): seconds per step and the "
        "speed-up of each N-rank program.", "",
        markdown_rows(["case", "one rank s/step", "cp speed-up", "dp speed-up"], speed), "",
        "Bytes saved for backward per rank in a step (MiB, the probe; the largest rank):", "",
        markdown_rows(["ranks", "one rank (N rows)", *names], saved), "",
        f"The longest single row each fits within the {out['budget'] / mib:.1f} MiB one rank saves for one row of "
        f"{MODEL['seq_len']} tokens (the memory calculator, bisecting the length over multiples of 2 x cp):", "",
        markdown_rows(["program", "longest sequence"], longest_rows),
    ])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 1-block model at 64 tokens: proves the script runs")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rounds, warmup = (2, 1) if args.tiny else (args.rounds, args.warmup)
    out = run(tiny=args.tiny, worlds=tuple(args.worlds), rounds=rounds, warmup=warmup)
    print(console_table(out["rows"]))
    print(section(out))
    if not args.no_doc and not args.tiny:
        update_section("context_parallel", section(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
