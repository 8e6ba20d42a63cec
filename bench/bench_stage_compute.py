"""Per-action compute: autopar's two pipeline stage graphs against torch's stage modules, one process.

What ``bench_pipeline``'s floor leaves open is whether autopar's actions themselves cost what the
peer's do. This benchmark answers it without a pipeline: one process, one thread, no process
group. autopar lowers the pipeline benchmark's GPT (8 blocks, hidden 256, cut where its planner
cuts) for pp=2 and runs both stage graphs on this rank, the transfer between them a local hand-over
(``P2PChannel`` with both stages on rank 0), through the executor's own ``run_actions`` (F of
stage 0, F of stage 1 with the loss, B of stage 1, B of stage 0). The peer is
``bench_pipeline``'s ``FirstStage`` / ``LastStage`` modules on the same weights, run the same four
steps by hand (forward, ``lm_loss``, ``backward``, ``backward`` of the first stage with the
received gradient), as torch pipelining's stages run them. Microbatches alternate between the two
(order flipped every microbatch); each action's median duration is reported, and the ratio.

    python bench/bench_stage_compute.py            # ~1 min; prints, updates docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_pipeline  # noqa: E402
from _report import markdown_rows, stamped, run_note, update_section  # noqa: E402

__all__ = ["run", "section", "main"]

ACTIONS = ("F stage 0", "F stage 1 (with loss)", "B stage 1", "B stage 0")
MICROBATCH_SIZES = (8, 4, 2)  # 4, 8 and 16 microbatches of the pipeline benchmark's batch of 32


def _lowered(model, data, num_microbatches: int):
    from autopar.lowering import lower
    from autopar.models import lm_loss
    from autopar.ops.p2p import P2PChannel, P2PNode
    from autopar.plan_model import MeshShape
    from autopar.validation import checked_options
    shape = MeshShape(dp=1, pp=2, tp=1)
    x, y = data[0]
    options = checked_options({"schedule": "1f1b", "num_microbatches": num_microbatches}, mesh=shape,
                              plan=None, where="bench_stage_compute")
    low = lower(copy.deepcopy(model), mesh=shape, tp_rank=0, example_inputs=(x,), example_target=y,
                loss_fn=lm_loss, options=options)
    channel = P2PChannel(rank=0, stage_to_rank={0: 0, 1: 0})  # both stages here: local hand-overs
    for stage in low.stages:
        for module in stage.gm.modules():
            if isinstance(module, P2PNode):
                module.bind(channel)
    return {s.stage: s for s in low.stages}, channel, bench_pipeline._split_index(low.plan.pipeline.stage_starts)


def _measure(size: int, *, rounds: int) -> dict:
    from autopar.models import lm_loss
    from autopar.runtime.execution.executor import run_actions
    from autopar.runtime.schedules.action import Action, ActionKind
    data, model = bench_pipeline._data(), bench_pipeline._build_model()
    m = bench_pipeline.BATCH // size
    stages, channel, split = _lowered(model, data, m)
    gpt = copy.deepcopy(model)
    first, last = bench_pipeline.FirstStage(gpt, split), bench_pipeline.LastStage(gpt, split)
    x, y = data[0]
    batches = [{"idx": x[i * size:(i + 1) * size], "target": y[i * size:(i + 1) * size]} for i in range(m)]

    def autopar_microbatch(i: int) -> list[float]:
        actions = (Action(0, ActionKind.F, i), Action(1, ActionKind.F, i), Action(1, ActionKind.B, i),
                   Action(0, ActionKind.B, i))
        events: list = []
        run_actions(actions, stages=stages, microbatches=[batches[i] if k == i else None for k in range(m)],
                    channel=channel, train=True, events=events)
        return [end - start for _, start, end in events]

    def torch_microbatch(i: int) -> list[float]:
        b, out = batches[i], []
        t = time.perf_counter()
        sent = first(b["idx"])
        out.append(time.perf_counter() - t)
        received = sent.detach().requires_grad_()
        t = time.perf_counter()
        loss = lm_loss(last(received), b["target"]) / m
        out.append(time.perf_counter() - t)
        t = time.perf_counter()
        loss.backward()
        out.append(time.perf_counter() - t)
        t = time.perf_counter()
        sent.backward(received.grad)
        out.append(time.perf_counter() - t)
        return out

    mine, peer = [], []
    for r in range(rounds + 1):  # the first round warms up (discarded)
        for module in (first, last, *(s.gm for s in stages.values())):
            module.zero_grad(set_to_none=True)
        for i in range(m):
            pair = (lambda: mine.append(autopar_microbatch(i)), lambda: peer.append(torch_microbatch(i)))
            for go in (pair if (r + i) % 2 == 0 else pair[::-1]):
                go()
        if r == 0:
            mine, peer = [], []
    medians = [(statistics.median(a[k] for a in mine), statistics.median(p[k] for p in peer))
               for k in range(len(ACTIONS))]
    return dict(case=f"{m} mb of {size}", medians=medians, samples=len(mine),
                ratio=sum(a for a, _ in medians) / sum(p for _, p in medians))


def run(*, sizes=MICROBATCH_SIZES, rounds: int = 6) -> list[dict]:
    """Every microbatch size in this process (one thread), stamped with date and load."""
    torch.set_num_threads(1)
    return stamped(lambda: [_measure(size, rounds=rounds) for size in sizes])


def section(rows: list[dict]) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    header = ["microbatches", *[f"{a}: autopar / torch ms" for a in ACTIONS], "all four: ratio", "samples each"]
    body = [[r["case"], *[f"{a * 1e3:.2f} / {p * 1e3:.2f}" for a, p in r["medians"]], f"{r['ratio']:.3f}",
             str(r["samples"])] for r in rows]
    return "\n".join([
        "## Per-action compute: autopar's stage graphs vs torch's stage modules (one process)",
        "",
        run_note(rows),
        "",
        "The pipeline benchmark's GPT 8x256 (cut where autopar cuts it), both stages in one process and one "
        "thread, the transfer a local hand-over: autopar's `run_actions` on its two stage graphs against "
        "`FirstStage` / `LastStage` run by hand on the same weights, microbatches alternating "
        "(`bench/bench_stage_compute.py`). Median action durations; the ratio is of their sums.",
        "",
        markdown_rows(header, body),
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = run(rounds=args.rounds)
    for r in rows:
        print(f"{r['case']}: " + ", ".join(f"{n} {a * 1e3:.2f}/{p * 1e3:.2f} ms" for n, (a, p)
                                           in zip(ACTIONS, r["medians"])) + f"; all four {r['ratio']:.3f}")
    if not args.no_doc:
        update_section("stage_compute", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
