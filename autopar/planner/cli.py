"""``autopar plan``: let the planner choose, and print its ranked table, its reasons and the Plan.

    autopar plan autopar.models.examples:gpt_tiny --world 8 --cluster cpu-2core
    autopar plan autopar.models.examples:llama2_70b_meta --cluster a100-80g-8x --nodes 128 --precision bf16
    autopar plan autopar.models.examples:gpt_tiny --world 4 --mesh tp=2 --schedule 1f1b --rank 0
    autopar plan autopar.models.examples:llama2_7b_meta --cluster a100-80g-8x --world 8 --mesh tp=8 \
        --precision bf16 --max-seq
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from autopar.errors import PlanError

__all__ = ["add_plan_command"]

_DESCRIPTION = """\
Choose a plan with autopar's planner, in this one process (no process group, no GPUs): every
dp x pp x tp mesh that fits the cluster, microbatches, schedule, ZeRO stage, recomputation and
stage boundaries are estimated (step time, memory per rank); the table ranks those that fit, with
some rejected ones and why, then the chosen Plan and the reasons it won.

TARGET is MODULE:CALLABLE returning (model, example_inputs, loss_fn, example_target), as for
'autopar inspect'. Models built under torch.device("meta") plan without allocating weights.
--input-shape, --input-dtype and --vocab replace the inputs a target returns (the target is
resized along with them: same shape as the first input, or the same batch); the shape planned
for is printed first. Warnings say when the global batch is too small for the plan. The last
lines are the chosen pipeline's critical path (the actions and transfers that make its step as
long as it is) and, with --max-seq, the memory of the fullest rank as a formula of the microbatch
size and the sequence length, solved for the longest sequence (and the largest microbatch) that
fits the cluster's devices with the chosen plan.

--explain prints where the estimated step time goes and, given your measured step time
(--measured-step-s), which part most likely differs. --published ID estimates a run of autopar's
table of published runs (autopar/planner/data/published_runs.json) in its own configuration beside its
measured step time, and the planner's own choice on the same GPUs."""

_EPILOG = """\
examples:
  autopar plan autopar.models.examples:gpt_tiny --world 8 --cluster cpu-2core
  autopar plan autopar.models.examples:llama2_70b_meta --cluster a100-80g-8x --nodes 128 --precision bf16
  autopar plan autopar.models.examples:gpt_tiny --world 4 --mesh tp=2 --rank 0
  autopar plan autopar.models.examples:llama2_70b_meta --cluster a100-80g-8x --nodes 128 --precision bf16 \
      --input-shape 1024x4096
  autopar plan autopar.models.examples:llama2_7b_meta --cluster a100-80g-8x --world 1 --precision bf16 \
      --optimizer sgd --max-seq
  autopar plan autopar.models.examples:gpt_tiny --world 4 --cluster cpu-2core --mesh dp=1,pp=2,tp=2 \
      --explain --measured-step-s 0.5
  autopar plan --published megatron21-t1-gpt-1008b --explain
clusters: a100-80g-8x, a100-40g-8x, h100-80g-8x, cpu-2core, or a JSON file of an autopar.planner.Cluster"""


def _cluster(text: str | None):
    from autopar.planner.cluster import CLUSTER_PRESETS, Cluster, local_cluster

    if text is None:
        return local_cluster()
    if text in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[text]
    try:
        with open(text) as f:
            return Cluster.model_validate_json(f.read())
    except OSError as exc:
        raise PlanError(f"--cluster {text!r} is neither a preset nor a readable file: {exc}", where="--cluster",
                        fix=f"use one of {', '.join(CLUSTER_PRESETS)} or a JSON file of a Cluster") from exc


def _pins(args: argparse.Namespace) -> dict:
    options = {}
    for key in ("schedule", "num_microbatches", "zero_stage", "recompute", "precision"):
        value = getattr(args, key)
        if value is not None:
            options[key] = value
    if args.virtual is not None:
        options["num_virtual"] = args.virtual
    if args.max_seq:  # the plan is made at the example's length; the formula then reads every other length
        options["dynamic_shapes"] = "static"
    return options


def _run_plan(args: argparse.Namespace) -> int:
    import autopar
    from autopar.cli_args import load_target, parse_mesh, unpack_target as _unpack
    from autopar.planner.cluster import get_cluster

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.published:
        return _run_published(args)
    if args.target is None:
        raise PlanError("autopar plan needs a TARGET (or --published ID)", where="autopar plan",
                        fix="pass MODULE:CALLABLE, e.g. autopar.models.examples:gpt_tiny, or --published ID")
    if args.measured_step_s is not None and not args.explain:
        raise PlanError("--measured-step-s is read by --explain", where="--measured-step-s", fix="add --explain")
    cluster = _cluster(args.cluster)
    if args.nodes is not None:
        cluster = get_cluster(cluster, nodes=args.nodes)
    world = args.world or cluster.world_size
    shape: dict = {"world": world}
    if args.mesh:
        pinned = parse_mesh(args.mesh)
        shape.update({axis: getattr(pinned, axis) for axis in ("dp", "cp", "pp", "tp")
                      if f"{axis}=" in args.mesh.replace(" ", "")})
    target = load_target(args.target)
    kwargs = _unpack(target, argparse.Namespace(**{**vars(args), "input_dtype": args.input_dtype or "long"}))
    if not isinstance(target, torch.nn.Module):
        kwargs = _override_inputs(kwargs, args)
    if "loss_fn" not in kwargs:
        raise PlanError("the target returned no loss_fn: the planner plans training", where="TARGET",
                        fix="return (model, example_inputs, loss_fn, example_target)")
    kwargs_inputs = kwargs["example_inputs"]
    shapes = [list(t.shape) for t in kwargs_inputs if isinstance(t, torch.Tensor)]
    ranks = [args.rank] if args.rank is not None else [0]
    result = autopar.plan(kwargs.pop("model"), shape, plan="auto", cluster=cluster, ranks=ranks,
                          optimizer=args.optimizer, **kwargs, **_pins(args))
    fit = _max_seq(result, args) if args.max_seq else None
    if args.json:
        print(json.dumps({"plan": json.loads(result.plan.model_dump_json()), "inputs": shapes,
                          "estimate_s": result.planner.best.step_time,
                          "memory_bytes": result.planner.best.memory,
                          "warnings": result.planner.warnings, **({"max_seq": fit[1]} if fit else {})}, indent=2))
        return 0
    print(f"planned for inputs {', '.join(_describe(t) for t in kwargs_inputs)} "
          f"(global batch {result.planner.result.global_batch})")
    print(result.planner.table(top=args.top))
    print()
    print(result.planner.summary())
    print()
    print(result.summary())
    print(result.planner.critical_path(optimizer=args.optimizer).summary(unit="s"))
    if fit:
        print("\n".join(fit[0]))
    if args.rank is not None:
        print()
        print(result.describe_rank(args.rank))
    if args.explain:
        from autopar.planner.measured import explain_step
        print()
        print("\n".join(explain_step(result.planner.best, measured=args.measured_step_s)))
    return 0


def _run_published(args: argparse.Namespace) -> int:
    """``--published ID``: the run's own configuration estimated beside its measured step time, and the
    planner's own choice on the same GPUs (autopar/planner/published_fit.py)."""
    from autopar.planner.measured import explain_step
    from autopar.planner.published import published_runs
    from autopar.planner.published_fit import evaluate

    runs = {r.id: r for r in published_runs()}
    if args.published not in runs:
        raise PlanError(f"no published run {args.published!r}", where="--published",
                        fix=f"use one of {', '.join(runs)}")
    if args.target is not None:
        raise PlanError("--published plans the run's own model: pass no TARGET", where="--published",
                        fix=f"autopar plan --published {args.published} --explain")
    run = runs[args.published]
    (row,) = evaluate([run], choose=True)
    print(f"{run.id}: {run.model.layers} layers, width {run.model.hidden}, {run.gpus} {run.gpu} GPUs, "
          f"tp={run.tp} pp={run.pp} dp={run.dp}, batch {run.global_batch} x {run.model.seq} tokens "
          f"({run.source.where})")
    measured = args.measured_step_s if args.measured_step_s is not None else run.step_seconds
    print("\n".join(explain_step(row.estimate, measured=measured)))
    c = row.choice
    print(f"the planner's own choice on these GPUs: {c.candidate.label()}: {c.step_time:.4g} s/step "
          f"({(c.step_time / row.estimate.step_time - 1) * 100:+.0f}% against the run's configuration), "
          f"{c.memory / 2**30:.1f} GiB of {c.capacity / 2**30:.1f} GiB on the fullest rank")
    return 0


def _max_seq(result, args) -> tuple[list[str], int | None]:
    """(the lines --max-seq prints, the longest sequence) for the chosen plan on the cluster's devices."""
    from autopar.memory.formula import memory_formula
    from autopar.memory.solve import fit_report, longest_sequence
    from autopar.planning import rank_of

    shape = result.plan.mesh
    for pp in range(shape.pp):  # tp rank 0 of every pp and dp rank (their graphs are built once per pp rank)
        for dp in range(shape.dp):
            result.rank_program(rank_of(dp=dp, pp=pp, tp=0, shape=shape))
    formula = memory_formula(result, optimizer=args.optimizer)
    cluster = result.planner.cluster
    capacity = min(cluster.usable_bytes(r) for r in range(shape.world_size))
    where = f"{cluster.device.name} {cluster.device.memory_gb:g} GB less the {cluster.memory_reserve:.0%} reserve"
    lines = fit_report(formula, capacity=capacity, step=args.seq_step, where=where)
    return lines, longest_sequence(formula, capacity=capacity, step=args.seq_step)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise PlanError(f"cannot read --input-shape {text!r}", where="--input-shape",
                        fix="write the dims joined by x, batch first, e.g. 1024x4096")
    return shape


def _like(old: torch.Tensor, shape, dtype, *, vocab, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``old``'s device: empty on meta, else seeded random data."""
    if old.device.type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype).to(old.device)
    high = vocab or (int(old.max()) + 1 if old.numel() else 2)
    return torch.randint(0, high, shape, generator=gen, dtype=dtype).to(old.device)


def _override_inputs(kwargs: dict, args: argparse.Namespace) -> dict:
    """The target's inputs replaced as --input-shape / --input-dtype / --vocab say (the target resized too)."""
    from autopar.cli_args import DTYPES as _DTYPES

    if not (args.input_shape or args.input_dtype or args.vocab):
        return kwargs
    inputs = kwargs["example_inputs"]
    first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    if first is None or first.dim() == 0:
        raise PlanError("--input-shape needs a target whose first input is a tensor with a batch dim",
                        where="--input-shape", fix="return (model, (tensor, ...), loss_fn, target) from TARGET")
    shape = _shape(args.input_shape) if args.input_shape else tuple(first.shape)
    dtype = _DTYPES[args.input_dtype] if args.input_dtype else first.dtype
    vocab = args.vocab or getattr(getattr(kwargs["model"], "cfg", None), "vocab_size", None)
    batch = first.shape[0]

    def resized(t, seed: int, new_dtype=None):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        new_shape = shape if tuple(t.shape) == tuple(first.shape) else (shape[0], *t.shape[1:])
        return _like(t, new_shape, new_dtype or t.dtype, vocab=vocab, seed=seed)

    out = dict(kwargs, example_inputs=(resized(first, args.seed, dtype),
                                       *(resized(t, args.seed + 1 + i) for i, t in enumerate(inputs[1:]))))
    if "example_target" in kwargs:
        out["example_target"] = resized(kwargs["example_target"], args.seed + len(inputs))
    return out


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return "x".join(str(d) for d in t.shape) + f" {str(t.dtype).removeprefix('torch.')}"


def add_plan_command(sub) -> None:
    """Register ``autopar plan`` on the CLI's subparsers."""
    from autopar.cli_args import DTYPES as _DTYPES, positive_int
    from autopar.runtime.schedules.registry import schedule_names

    p = sub.add_parser("plan", help="let the planner choose a plan and print its ranked table and reasons",
                       description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="MODULE:CALLABLE returning (model, inputs, loss_fn, target)")
    p.add_argument("--world", type=positive_int, default=None, metavar="N",
                   help="ranks to plan for (default: every device of the cluster)")
    p.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help="cluster preset or Cluster JSON file (default: this machine, uncalibrated)")
    p.add_argument("--nodes", type=positive_int, default=None, metavar="N", help="nodes of the cluster preset")
    p.add_argument("--mesh", default=None, help="pin some degrees, e.g. tp=8 (others are searched)")
    p.add_argument("--schedule", default=None, choices=schedule_names(), metavar="NAME", help="pin the schedule")
    p.add_argument("--microbatches", dest="num_microbatches", type=positive_int, default=None, metavar="N",
                   help="pin the microbatch count")
    p.add_argument("--virtual", type=positive_int, default=None, metavar="V", help="pin stages per pp rank")
    p.add_argument("--zero", dest="zero_stage", type=int, choices=(0, 1, 2, 3), default=None, help="pin the ZeRO stage")
    p.add_argument("--recompute", default=None, choices=("none", "selective", "full"), help="pin recomputation")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16"), help="compute precision (default fp32)")
    p.add_argument("--optimizer", default="adam", choices=("sgd", "momentum", "adam", "adamw"),
                   help="the optimizer whose state memory is sized (default adam)")
    p.add_argument("--max-seq", action="store_true",
                   help="also print the fullest rank's memory as a formula of microbatch size and sequence length, "
                        "and the longest sequence and largest microbatch that fit with the chosen plan (planned at the "
                        "example's own length, not at the sequence bound)")
    p.add_argument("--seq-step", type=positive_int, default=1, metavar="N",
                   help="with --max-seq: sequence lengths are multiples of N (default 1)")
    p.add_argument("--top", type=positive_int, default=10, metavar="N", help="rows of the ranked table (default 10)")
    p.add_argument("--rank", type=int, default=None, metavar="R", help="also print rank R's rewritten program")
    p.add_argument("--json", action="store_true", help="print the chosen Plan (and its estimate) as JSON")
    p.add_argument("--explain", action="store_true",
                   help="print where the estimated step time goes (compute, tp, bubble, dp, optimizer) and, with "
                        "--measured-step-s, which part most likely differs from the measurement")
    p.add_argument("--measured-step-s", type=float, default=None, metavar="S",
                   help="your measured seconds per step of the plan pinned with --mesh etc. (read by --explain)")
    p.add_argument("--published", default=None, metavar="ID",
                   help="instead of TARGET: a run of autopar's table of published runs (its model, GPUs and "
                        "configuration; its measured step time unless --measured-step-s)")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    bare = p.add_argument_group("example inputs: for a target that returns a bare model, or in place of the "
                                "inputs a target returns")
    bare.add_argument("--input-shape", metavar="DxD..", help="shape of the first input, batch first, e.g. 1024x4096")
    bare.add_argument("--input-dtype", default=None, choices=sorted(_DTYPES),
                      help="its dtype (default long, or the target's)")
    bare.add_argument("--vocab", type=positive_int, default=None, metavar="N",
                      help="integer inputs are drawn from [0, N) (default: model.cfg.vocab_size)")
    bare.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=_run_plan)
