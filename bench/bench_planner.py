"""The planner against measurement: predicted and measured step times of many configurations.

For each reference model (GPT and Llama, 8 blocks, width 256, sequence 64, global batch 32, AdamW)
and each world size (2 and 4 gloo ranks on this machine), one spawned process group:

1. *Calibrate* (:mod:`autopar.planner.calibrate`): every rank, while the others do the same,
   measures gloo all-reduce and p2p alpha/beta and the switch time of ranks blocking on each other
   (:func:`~autopar.planner.calibrate.measure_switch`), then profiles the model itself: forward and
   backward at every microbatch size a configuration can have (1 to 32 samples) and one AdamW step.
   The cost model's per-op overhead comes from a chain of tiny ops, its matmul rate is fitted to the
   pass at 16 samples (:func:`~autopar.planner.calibrate.fit_device`) and its change with the
   microbatch to the others (:func:`~autopar.planner.calibrate.fit_batch_efficiency`), its memory
   bandwidth to the optimizer step. That gives a :class:`~autopar.planner.cluster.Cluster` for this
   machine and model, now (where ranks outnumber cores, as a lone rank's figures plus the cores).
2. *Predict*: the planner's cost model (profile of the model, computed once in the parent) gives
   each configuration's step time; the planner's own first choice (unrestricted search) joins the
   list if it is not on it.
3. *Measure*: every configuration is compiled with the planner's Plan (its stage boundaries) and
   trained in rounds, the order alternating each round (A B C, C B A, ...) so load drift hits all
   alike; each round first re-runs the calibration's forward and backward of each model, and the
   prediction of that round is scaled by its time against the calibration's (other engineers'
   jobs share the 2 cores: the load average is 10-25).

Reported per configuration: predicted and measured median s/step and their ratio; per group: the
median absolute error, and whether the planner's first choice among the measured configurations
is within 10% of the best measured one.

    python bench/bench_planner.py                  # ~20 min under load; prints, updates docs
    python bench/bench_planner.py --rounds 3 --worlds 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _report import run_note, update_section
from _spawn import spawn

__all__ = ["MODELS", "CONFIGS", "run", "section", "main"]

BATCH = 32
SEED = 0
PROBE = 16  # batch of the calibration's forward and backward (the matmul rate is fitted there)
SIZES = (1, 2, 4, 8, 16, 32)  # every microbatch a configuration of batch 32 can have: the rate at each
MODELS = {
    "GPT": dict(name="gpt_tiny", num_layers=8, hidden=256, num_heads=8, seq_len=64),
    "Llama": dict(name="llama_tiny", num_layers=8, hidden=256, num_heads=8, num_kv_heads=8, intermediate=704,
                  seq_len=64),
}
# (dp, pp, tp, microbatches, schedule, zero_stage[, virtual stages]) per world size and model
CONFIGS = {
    2: {"GPT": [(2, 1, 1, 1, "1f1b", 0), (2, 1, 1, 1, "1f1b", 1), (1, 2, 1, 4, "1f1b", 0), (1, 2, 1, 4, "gpipe", 0),
                (1, 2, 1, 8, "1f1b", 0), (1, 1, 2, 1, "1f1b", 0), (1, 2, 1, 4, "zb_v", 0, 2)],
        "Llama": [(2, 1, 1, 1, "1f1b", 0), (1, 2, 1, 4, "1f1b", 0), (1, 1, 2, 1, "1f1b", 0)]},
    4: {"GPT": [(4, 1, 1, 1, "1f1b", 0), (2, 2, 1, 4, "1f1b", 0), (1, 4, 1, 8, "1f1b", 0), (2, 1, 2, 1, "1f1b", 0),
                (1, 2, 2, 4, "1f1b", 0), (1, 1, 4, 1, "1f1b", 0), (1, 4, 1, 16, "zb_v", 0, 2)],
        "Llama": [(4, 1, 1, 1, "1f1b", 0), (2, 2, 1, 4, "1f1b", 0), (2, 1, 2, 1, "1f1b", 0)]},
}


def _build(model_key: str):
    from autopar.models import build_model
    spec = MODELS[model_key]
    torch.manual_seed(SEED)
    return build_model(spec["name"], **{k: v for k, v in spec.items() if k != "name"})


def _data(model_key: str):
    from autopar.models import TextBatches
    batch = next(iter(TextBatches(seq_len=MODELS[model_key]["seq_len"], batch_size=BATCH, seed=SEED)))
    return batch


def _profile(model_key: str, world: int):
    from autopar.models import lm_loss
    from autopar.planner.profile import profile_model
    x, y = _data(model_key)
    tps = [t for t in (1, 2, 4) if world % t == 0]
    return profile_model(_build(model_key), example_inputs=(x,), loss_fn=lm_loss, example_target=y, tp_degrees=tps)


def _candidate(cfg):
    """(dp, pp, tp, microbatches, schedule, zero_stage[, virtual stages]) as a Candidate."""
    from autopar.planner.cost_model import Candidate
    dp, pp, tp, m, schedule, zero, *virtual = cfg
    return Candidate(dp, pp, tp, m, schedule, virtual[0] if virtual else 1, zero, "none")


def _model_cluster(model_key: str, profile, base_figures: dict, world: int):
    """This machine for ``model_key``: collectives from the microbenchmarks, compute fitted to the
    model's own forward/backward at every microbatch size and its optimizer step (every rank at once)."""
    from autopar.models import lm_loss
    from autopar.planner.calibrate import calibrated_cluster, combine, fit_batch_efficiency, fit_device, measure_model

    model = _build(model_key)
    x, y = _data(model_key)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timing = measure_model(model, example_inputs=(x,), loss_fn=lm_loss, example_target=y, sizes=SIZES,
                           optimizer=opt, repeats=5, sync=dist.barrier, min_seconds=0.8)
    elements = sum(p.numel() for p in model.parameters())
    figures = dict(base_figures, memory_bandwidth=elements * 28 / timing["optimizer"])
    figures.update(fit_device(profile, {PROBE: timing[PROBE]}, memory_bandwidth=figures["memory_bandwidth"],
                              op_overhead_s=base_figures["op_overhead_s"]))
    figures["batch_efficiency"] = fit_batch_efficiency(
        profile, timing, memory_bandwidth=figures["memory_bandwidth"], op_overhead_s=base_figures["op_overhead_s"],
        reference=PROBE)
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    cal = combine(gathered, world)
    return calibrated_cluster(cal), cal, timing[PROBE]


def _probe(model_key: str) -> float:
    """The calibration's forward and backward again: how loaded the machine is right now."""
    from autopar.models import lm_loss
    from autopar.planner.calibrate import measure_model
    x, y = _data(model_key)
    return measure_model(_build(model_key), example_inputs=(x,), loss_fn=lm_loss, example_target=y, sizes=(PROBE,),
                         repeats=2, sync=dist.barrier, min_seconds=0.8)[PROBE]


def _body(rank: int, world: int, jobs: dict, rounds: int, steps: int):
    """Calibrate, predict, compile every configuration, then time them in alternating rounds."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import lm_loss
    from autopar.options import CompileOptions
    from autopar.planner.auto import plan_from_estimate
    from autopar.planner.calibrate import measure_collectives, measure_compute, measure_switch
    from autopar.planner.cost_model import CostModel
    from autopar.planner.search import search
    from autopar.planner.stage_cuts import weighted_cuts

    base = measure_compute()
    base.update(measure_collectives())
    base["switch_s"] = measure_switch()
    entries, choices, calibrations, probes = [], {}, {}, {}
    for model_key, (profile, configs) in jobs.items():
        cluster, cal, probes[model_key] = _model_cluster(model_key, profile, base, world)
        calibrations[model_key] = cal.as_dict()
        cost = CostModel(profile, cluster)
        best = search(profile, cluster, world=world).best
        choices[model_key] = best.candidate.label()
        cands = [_candidate(c) for c in configs]
        if replace(best.candidate, cuts=()) not in cands:
            cands.append(replace(best.candidate, cuts=()))
        x, y = _data(model_key)
        for c in cands:
            cuts = tuple(weighted_cuts(cost.chunk_costs(c), c.num_stages)) if c.num_stages > 1 else ()
            est = cost.estimate(replace(c, cuts=cuts), simulate_pipeline=True)
            plan = plan_from_estimate(est, profile, options=CompileOptions())
            mesh = init_device_mesh("cpu", (c.dp, c.pp, c.tp), mesh_dim_names=("dp", "pp", "tp"))
            program = autopar.compile(_build(model_key), mesh, example_inputs=(x,), loss_fn=lm_loss,
                                      example_target=y, plan=plan)
            xs, ys = program.shard_batch(x), program.shard_batch(y)
            program.train_step(xs, target=ys)  # warm-up
            entries.append(dict(model=model_key, label=c.label(), predicted=est.step_time, parts=est.parts,
                                planner_choice=(replace(c, cuts=()) == replace(best.candidate, cuts=())),
                                step=lambda p=program, a=xs, b=ys: p.train_step(a, target=b), times=[],
                                scaled=[]))
    for r in range(rounds):
        scale = {}
        for model_key in jobs:
            now = torch.tensor([_probe(model_key)], dtype=torch.float64)
            dist.all_reduce(now)
            scale[model_key] = float(now) / world / probes[model_key]
        order = entries if r % 2 == 0 else entries[::-1]
        for e in order:
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                e["step"]()
                dist.barrier()
                e["times"].append(time.perf_counter() - t0)
                e["scaled"].append(e["predicted"] * scale[e["model"]])
    for e in entries:
        del e["step"]
    return {"entries": entries, "choices": choices, "calibration": calibrations}


def run(*, worlds=(2, 4), rounds: int = 6, steps: int = 2) -> list[dict]:
    """Every (world, model) group; rows of predicted vs measured step times."""
    rows = []
    for world in worlds:
        jobs = {key: (_profile(key, world), configs) for key, configs in CONFIGS[world].items()}
        out = spawn(_body, world_size=world, args=(jobs, rounds, steps), timeout_s=3600)
        for e in out["entries"]:
            measured = statistics.median(e["times"])
            predicted = statistics.median(e["scaled"])
            rows.append(dict(world=world, model=e["model"], label=e["label"], measured=measured,
                             predicted=predicted, predicted_raw=e["predicted"], ratio=predicted / measured,
                             planner_choice=e["planner_choice"], choice=out["choices"][e["model"]],
                             calibration=out["calibration"][e["model"]]))
        print(f"world {world} done", file=sys.stderr)
    return rows


def _groups(rows):
    keys = sorted({(r["world"], r["model"]) for r in rows})
    return [(k, [r for r in rows if (r["world"], r["model"]) == k]) for k in keys]


def section(rows: list[dict], note: str) -> str:
    """The docs/benchmarks.md section."""
    errors = [abs(r["ratio"] - 1) for r in rows]
    lines = [
        "## Planner: predicted against measured step time",
        "",
        note,
        "",
        "Models: GPT and Llama-style, 8 blocks, width 256, 8 heads, sequence 64, vocabulary 128, global batch 32, "
        "AdamW; gloo ranks with one thread each. Each group calibrates in its own process group, all ranks "
        "measuring at once: all-reduce and p2p alpha/beta, per-op overhead (a chain of tiny ops), the CPU time an "
        "action costs when ranks block on each other on shared cores (`measure_switch`), and a short profile of "
        "each model (forward and backward at 1 to 32 samples, one AdamW step) to which the cost model's matmul "
        "rate, its change with the microbatch size and the memory bandwidth are fitted; 4 ranks on 2 cores are "
        "modelled as lone ranks sharing the cores (pipelines simulated with processor sharing, "
        "`runtime/schedules/shared_cores.py`). It then compiles every configuration from the planner's Plan and "
        "times it in alternating rounds; each round re-runs that profile and scales that round's "
        "prediction by it (load drift). "
        "`predicted` is the cost model's step time (pipeline simulated), `measured` the median wall time of a "
        "barrier-bracketed step.",
        "",
        "| ranks | model | configuration | predicted s | measured s | predicted / measured | planner's pick |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['world']} | {r['model']} | {r['label']} | {r['predicted']:.3f} | {r['measured']:.3f} | "
                     f"{r['ratio']:.2f} | {'yes' if r['planner_choice'] else ''} |")
    lines += ["", f"Median absolute error over {len(rows)} configurations: **{statistics.median(errors):.1%}** "
                  f"(mean {statistics.mean(errors):.1%}, worst {max(errors):.1%}).", ""]
    for (world, model), group in _groups(rows):
        best = min(group, key=lambda r: r["measured"])
        pick = min(group, key=lambda r: r["predicted"])
        chosen = next((r for r in group if r["planner_choice"]), None)
        unrestricted = (f"{chosen['label']}, measured {chosen['measured']:.3f} s "
                        f"({chosen['measured'] / best['measured'] - 1:+.1%})" if chosen else group[0]["choice"])
        lines.append(f"- {world} ranks, {model}: the planner's first choice among these, {pick['label']}, measured "
                     f"{pick['measured']:.3f} s, {pick['measured'] / best['measured'] - 1:+.1%} from the best "
                     f"measured ({best['label']}, {best['measured']:.3f} s); its unrestricted first choice was "
                     f"{unrestricted}.")
    for (world, model), group in _groups(rows):
        table = ", ".join(f"{b}: {f:.2f}" for b, f in group[0]["calibration"]["batch_efficiency"])
        lines.append(f"- {world} ranks, {model}: matmul rate factor by samples per microbatch {table}.")
    cal = rows[0]["calibration"]
    lines += ["", f"Calibration of the first group: matmul {cal['matmul_flops'] / 1e9:.1f} GFLOP/s per rank, "
                  f"memory {cal['memory_bandwidth'] / 1e9:.2f} GB/s, {cal['op_overhead_s'] * 1e6:.0f} µs per op, "
                  f"all-reduce alpha {cal['allreduce_latency_s'] * 1e6:.0f} µs, beta "
                  f"{cal['allreduce_bandwidth'] / 1e9:.2f} GB/s, p2p alpha {cal['p2p_latency_s'] * 1e6:.0f} µs."]
    shared = [r for r in rows if r["calibration"].get("cores") and r["world"] > r["calibration"]["cores"]]
    if shared:
        cal = shared[0]["calibration"]
        lines += ["", f"On {shared[0]['world']} ranks ({cal['cores']} cores): switch time "
                      f"{cal['switch_s'] * 1e3:.2f} ms of CPU per pipeline action."]
    return "\n".join(lines)


def _rebalance_body(rank: int, world: int, bad: tuple, rounds: int, steps: int):
    """A mis-split GPT pipeline, re-split by the LoadBalancer; both programs then timed alternately."""
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import lm_loss
    from autopar.plan_model import MeshShape, PipelinePlan, Plan
    from autopar.planner.rebalance import LoadBalancer

    x, y = _data("GPT")
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    plan = Plan(global_batch_size=BATCH, mesh=MeshShape(pp=2),
                pipeline=PipelinePlan(schedule="1f1b", num_microbatches=4, stage_starts=bad))
    old = autopar.compile(_build("GPT"), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=plan)
    balancer = LoadBalancer(old)
    for _ in range(4):
        old.train_step(x, target=y)
        balancer.observe()
    proposal = balancer.propose()
    new = balancer.apply(proposal)
    new.train_step(x, target=y)  # warm-up
    times = {"before": [], "after": []}
    for r in range(rounds):
        for key in (("before", "after") if r % 2 == 0 else ("after", "before")):
            program = old if key == "before" else new
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                program.train_step(x, target=y)
                dist.barrier()
                times[key].append(time.perf_counter() - t0)
    return {"proposal": proposal.stage_starts, "gain": proposal.gain, "stage_seconds": proposal.stage_seconds,
            "before": statistics.median(times["before"]), "after": statistics.median(times["after"]),
            "bad": bad}


def rebalance(*, bad=("blocks.1",), rounds: int = 6, steps: int = 2) -> dict:
    """Step time of a mis-split 2-stage GPT pipeline before and after the LoadBalancer re-splits it."""
    return spawn(_rebalance_body, world_size=2, args=(tuple(bad), rounds, steps), timeout_s=1800)


def rebalance_section(r: dict, note: str) -> str:
    return "\n".join([
        "## Dynamic re-balancing: a mis-split pipeline, re-split while training", "", note, "",
        f"GPT (8 blocks, width 256, sequence 64, batch 32, 4 microbatches, 1F1B) on 2 pipeline ranks, compiled "
        f"with stage 1 starting at `{r['bad'][0]}` (one block on the first rank, seven and the head on the "
        f"second). After 4 steps the `LoadBalancer` measured {r['stage_seconds'][0]:.3f} s and "
        f"{r['stage_seconds'][1]:.3f} s of busy time per step on the two stages and proposed `"
        f"{', '.join(r['proposal'])}` (predicted {r['gain']:.0%} off the slowest stage); `apply` recompiled and "
        f"moved weights and Adam state through a checkpoint. Both programs were then timed in alternating "
        f"rounds: **{r['before']:.3f} s/step before, {r['after']:.3f} s/step after** "
        f"({r['after'] / r['before'] - 1:+.0%}).",
    ])


SCALE = {"llama2_70b": 1024, "gpt3_175b": 1536}  # preset -> global batch (sequences)


def scale(name: str, *, world: int = 1024, rank: int = 0) -> dict:
    """Plan ``name`` (meta device) for ``world`` A100-80GB ranks and build one rank's program; timed."""
    import autopar
    from autopar.models import build_model, lm_loss
    from autopar.planner import get_cluster

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model = build_model(name)
    tokens = torch.empty((SCALE[name], model.cfg.seq_len), dtype=torch.long, device="meta")
    built = time.perf_counter() - t0
    result = autopar.plan(model, world, plan="auto", cluster=get_cluster("a100-80g-8x", world=world),
                          example_inputs=(tokens,), loss_fn=lm_loss, example_target=tokens, ranks=[rank],
                          precision="bf16")
    program = result.rank_program(rank)
    nodes = sum(len(s.gm.graph.nodes) for s in program.stages)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    from autopar.planner.candidates import SearchSpace
    from autopar.planner.search import search
    report = result.planner
    megatron = search(report.profile, report.cluster, world=world, space=SearchSpace(tp=(8,), pp=(8,))).best
    return dict(name=name, world=world, rank=rank, wall_s=wall, cpu_s=cpu, build_s=built, plan=result.plan.summary(),
                megatron=f"{megatron.candidate.label()}: {megatron.step_time:.4g} s/step, "
                         f"{megatron.memory / 2**30:.1f} GiB",
                table=result.planner.table(top=5, rejected=3), reasons=result.planner.summary(),
                coords=program.coords, stages=[s.stage for s in program.stages], nodes=nodes,
                load=os.getloadavg()[0])


PLANNER_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "planner.md")


def scale_section(results: list[dict]) -> str:
    """The 1,024-rank plans as a section of ``docs/planner.md``."""
    lines = [f"Measured {time.strftime('%c')} on this machine (`python bench/bench_planner.py --scale`):", ""]
    for r in results:
        lines += [f"**{r['name']} on {r['world']} ranks: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU** "
                  f"(model built on the meta device in {r['build_s']:.1f} s; 1-minute load average "
                  f"{r['load']:.1f}). Rank {r['rank']} at {r['coords']} runs stages {r['stages']} "
                  f"({r['nodes']} graph nodes).", "", "```text", r["table"], "",
                  f"pinned to Megatron's tp=8, pp=8: {r['megatron']}", "", r["reasons"], "", r["plan"], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--rebalance", action="store_true",
                   help="instead: time a mis-split pipeline before and after the LoadBalancer re-splits it")
    p.add_argument("--scale", nargs="*", metavar="PRESET", default=None,
                   help="instead: plan llama2_70b / gpt3_175b for 1,024 A100s and build one rank's program, timed")
    args = p.parse_args(argv)
    if args.rebalance:
        load, t0 = os.getloadavg()[0], time.perf_counter()
        r = rebalance(rounds=args.rounds, steps=args.steps)
        note = run_note([dict(date=time.strftime("%c"), wall_s=time.perf_counter() - t0, load_before=load,
                              load_after=os.getloadavg()[0])])
        text = rebalance_section(r, note)
        print(text)
        if not args.no_docs:
            update_section("planner_rebalance", text)
        return 0
    if args.scale is not None:
        results = [scale(name) for name in args.scale or list(SCALE)]
        text = scale_section(results)
        print(text)
        if not args.no_docs:
            update_section("planner_scale", text, path=PLANNER_DOC)
        return 0
    load, t0 = os.getloadavg()[0], time.perf_counter()
    rows = run(worlds=tuple(args.worlds), rounds=args.rounds, steps=args.steps)
    note = run_note([dict(rows[0], date=time.strftime("%c"), wall_s=time.perf_counter() - t0, load_before=load,
                          load_after=os.getloadavg()[0])])
    text = section(rows, note)
    print(text)
    if not args.no_docs:
        update_section("planner", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
