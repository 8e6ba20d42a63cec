"""Expert parallelism: autopar ep=2 against the same MoE model with replicated experts, on dp=2.

One run, 2 gloo ranks, one process group; both contenders train their own copy of the same MoE
model (``autopar.models.moe.MoeLM``: 4 blocks, hidden 128, 8 experts of 512, top-2 softmax
router, its load-balancing loss) on the same token batches (global batch 16, sequence 64) with
``moe_loss`` and AdamW(lr=1e-3), one forward/backward per step, ``zero_stage=0``:

- ``autopar ep=2``: each rank holds 4 of the 8 experts of every layer; tokens move by all-to-all;
- ``replicated experts``: autopar DDP (every rank holds every expert), the baseline ep=2 improves on;
- ``autopar ep=2, capacity 1.0``: ep=2 with ``moe_capacity_factor=1.0``; its dropped-row share is printed.

Step times alternate in rounds (``bench/_timing.py``); memory is the model state each rank holds
after a step (``autopar.runtime.state.model_state``), the larger of the two ranks.

    python bench/bench_moe.py                  # prints the tables, updates docs/benchmarks.md
    python bench/bench_moe.py --smoke          # the smallest setting, to check it runs (no doc update)
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist

from _report import console_table, markdown_table, run_note, stamped, update_section
from _spawn import spawn
from _timing import DEFAULTS, Contender, measure, row_cells

__all__ = ["MODEL", "run", "section", "main"]

# the plain-torch model computes its experts in the gathered form (each row indexes its expert's weights:
# rows x dim x ffn floats per expert matmul), so it is sized to fit 2 ranks in this machine's memory
MODEL = dict(vocab_size=64, dim=128, ffn=512, num_layers=4, num_experts=8, top_k=2, seq_len=64)
BATCH = 16
NUM_BATCHES = 4
SEED = 0


def _data(model: dict) -> list:
    g = torch.Generator().manual_seed(SEED)
    shape = (BATCH, model["seq_len"])
    return [(torch.randint(0, model["vocab_size"], shape, generator=g),
             torch.randint(0, model["vocab_size"], shape, generator=g)) for _ in range(NUM_BATCHES)]


def _build(model: dict):
    from autopar.models.moe import MoeConfig, MoeLM
    torch.manual_seed(SEED)
    return MoeLM(MoeConfig(**model))


def _contender(model, data, ep: int, capacity_factor: float | None = None):
    import autopar
    from autopar.models.moe import moe_loss
    from autopar.runtime.state.model_state import model_state_bytes
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=moe_loss,
                              example_target=data[0][1], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                              zero_stage=0, num_microbatches=1, expert_parallel=ep,
                              moe_capacity_factor=capacity_factor)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    name = f"autopar ep={ep}" if ep > 1 else "replicated experts"
    name += f", capacity {capacity_factor}" if capacity_factor is not None else ""
    return Contender(name, step), lambda: model_state_bytes(program), program


def _max_over_ranks(sizes: dict) -> dict:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sizes)
    return {k: max(s[k] for s in everyone) for k in sizes}


def body(rank: int, world: int, model_cfg: dict, rounds: int, steps_per_round: int, warmup: int) -> dict:
    """Every rank: both contenders from the same weights, timed together, then their model state."""
    assert world == 2, "the MoE benchmark runs on 2 ranks"
    data, model = _data(model_cfg), _build(model_cfg)
    from autopar.ops.moe_ops import dropped_rows
    contenders = [_contender(model, data, 2), _contender(model, data, 1), _contender(model, data, 2, 1.0)]
    timings = {t.name: t for t in measure([c for c, *_ in contenders], rounds=rounds,
                                          steps_per_round=steps_per_round, warmup=warmup)}
    memory = {c.name: _max_over_ranks(m()) for c, m, _ in contenders}
    dropped, seen = dropped_rows(contenders[2][2].graphs.values())
    totals = [None] * world
    dist.all_gather_object(totals, (dropped, seen))
    row = dict(case=f"MoE {model_cfg['num_layers']}x{model_cfg['dim']}, {model_cfg['num_experts']} experts, dp=2",
               **row_cells(timings["autopar ep=2"], timings["replicated experts"]))
    capped = dict(case=row["case"] + ", capacity factor 1.0",
                  **row_cells(timings["autopar ep=2, capacity 1.0"], timings["replicated experts"]))
    row["memory"] = memory
    row["dropped_share"] = sum(d for d, _ in totals) / max(1, sum(s for _, s in totals))
    return {"rows": [row, capped]}


def run(*, model: dict = MODEL, rounds: int = DEFAULTS["rounds"], steps_per_round: int = DEFAULTS["steps_per_round"],
        warmup: int = DEFAULTS["warmup"]) -> list[dict]:
    """Spawn 2 gloo ranks, run the benchmark, return rank 0's rows."""
    return stamped(lambda: spawn(body, world_size=2, args=(model, rounds, steps_per_round, warmup),
                                 timeout_s=900)["rows"])


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def memory_table(memory: dict) -> str:
    lines = ["| contender | params MB | grads MB | optimizer MB | model state MB |", "|---|---|---|---|---|"]
    for name, m in memory.items():
        lines.append(f"| {name} | {_mb(m['params'])} | {_mb(m['grads'])} | {_mb(m['optimizer'])} | "
                     f"{_mb(m['total'])} |")
    return "\n".join(lines)


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    return "\n".join([
        "## Mixture of experts: autopar ep=2 vs replicated experts on dp=2", "", run_note(rows), "",
        f"Model: `autopar.models.moe.MoeLM`, {MODEL['num_layers']} blocks, hidden {MODEL['dim']}, "
        f"{MODEL['num_experts']} experts of {MODEL['ffn']}, top-{MODEL['top_k']}; global batch {BATCH}, sequence "
        f"{MODEL['seq_len']}, AdamW, `zero_stage=0`, one microbatch. The peer column is autopar with every "
        "expert on every rank ([moe.md](moe.md)).", "",
        markdown_table(rows), "", "Model state per rank (the larger rank):", "", memory_table(rows[0]["memory"]),
        "", f"With `moe_capacity_factor=1.0` the dispatch dropped {rows[0]['dropped_share']:.1%} of the routed rows "
        "(their losses differ from the dropless runs from the first step).",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="smallest model, 1 round, no doc update")
    args = parser.parse_args(argv)
    if args.smoke:
        small = {**MODEL, "dim": 32, "ffn": 64, "num_layers": 2, "num_experts": 4, "seq_len": 16}
        rows = run(model=small, rounds=1, steps_per_round=1, warmup=1)
    else:
        rows = run()
    print(console_table(rows))
    print(memory_table(rows[0]["memory"]))
    print(f"capacity factor 1.0: {rows[0]['dropped_share']:.1%} of the routed rows dropped")
    if not args.smoke:
        update_section("moe", section(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
