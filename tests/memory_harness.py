"""Cases for recomputation, mixed precision, clipping and measured memory, run in shared process groups.

Every case runs under :func:`measured_run` (a runner of the equivalence harness, kind
``"memory_harness:measured_run"``): it trains like ``equivalence.parallel_run`` (losses and the
full state_dict for :func:`equivalence.assert_equivalent`) and also records, on every rank, the
bytes saved for backward by each stage forward of the first step and the model-state bytes held
after the last step (``autopar.runtime.diagnostics.memory_probe``). :func:`results` runs all cases of one
world size in one spawned group, once per test session; :func:`estimate` is the memory
calculator's figure for a case, computed in the test process.
"""
from __future__ import annotations

import functools

from equivalence import Case, batches, build, make_optimizer, replica_record, run_cases

KIND = "memory_harness:measured_run"
OPTIMIZER_KIND = {"sgd": "momentum", "adam": "adamw"}  # equivalence.make_optimizer's choices


def _case(mesh, *, model="gpt_tiny", optimizer="sgd", **options) -> Case:
    return Case(model=model, mesh=mesh, options=tuple(options.items()), optimizer=optimizer, kind=KIND, steps=2)


# ZeRO 0-3 x dp {2, 4} x fp32/bf16: measured model states against the calculator (both optimizer kinds).
# The dp=4 fp32 ones also clip (ZeRO-1/2 owners and ZeRO-3 shards each count their part of the norm).
MEMORY = [_case((dp, 1, 1), zero_stage=z, precision=prec, optimizer=opt,
                **({"max_grad_norm": 0.05} if (dp, prec) == (4, "fp32") else {}))
          for dp, opts in ((2, {"fp32": "adam", "bf16": "sgd"}), (4, {"fp32": "sgd", "bf16": "adam"}))
          for prec, opt in opts.items() for z in (0, 1, 2, 3)]
# Recompute with tp collectives inside the regions and p2p outside them: equal results, less memory.
RECOMPUTE = [_case((1, 1, 2), recompute="none"), _case((1, 1, 2), recompute="selective"),
             _case((1, 1, 2), recompute="full", max_grad_norm=0.05),
             _case((1, 2, 1), model="llama_tiny", recompute="selective", max_grad_norm=0.05),
             _case((1, 2, 1), model="llama_tiny", recompute="full"),
             _case((1, 2, 2), recompute="full", max_grad_norm=0.05),  # all of it on one mesh
             _case((1, 2, 2), model="llama_tiny", recompute="selective"),
             _case((1, 2, 1), recompute="full", schedule="zb_h1"),  # split backward: W re-enters regions
             _case((2, 1, 1), recompute="selective", zero_stage=3, max_grad_norm=0.05)]  # gathers around regions
# Clipping by the global norm (max_grad_norm small enough to be active): tp shards and replicas,
# a weight tied across pp stages, dp replicas and ZeRO shards (more in MEMORY and RECOMPUTE).
CLIP = [_case((1, 2, 1), max_grad_norm=0.05), _case((2, 1, 1), model="llama_tiny", max_grad_norm=0.05)]
# bf16 over p2p (with recompute) and tp collectives (the dp ones are in MEMORY): a bf16 tolerance.
PRECISION = [_case((1, 2, 1), precision="bf16", recompute="selective"),
             _case((1, 1, 2), model="llama_tiny", precision="bf16")]
# Context parallelism: ZeRO-1/2/3 over dp x cp (model states against the calculator) on cp=2; llama_tiny at a
# sequence of 256 whole on one rank and cut over cp=4 by each strategy: the bytes each rank saves for backward
# (the acceptance of issue 36: the cut at most 0.3 of the whole; the calculator equal to the measurement).
CP_STATES = [Case(model="gpt_tiny", cp=2, options=(("zero_stage", z), ("cp_strategy", "ring")), kind=KIND, steps=2)
             for z in (1, 2, 3)]
CP_SEQ = (("seq_len", 256),)
CP_WHOLE = Case(model="llama_tiny", kind=KIND, steps=2, overrides=CP_SEQ)
CP_CUT = [Case(model="llama_tiny", cp=4, options=(("cp_strategy", s),), kind=KIND, steps=2, overrides=CP_SEQ)
          for s in ("ring", "all_to_all")]
CP = CP_STATES + [CP_WHOLE] + CP_CUT
ALL = MEMORY + RECOMPUTE + CLIP + PRECISION + CP
# Asynchronous schedules (kind ASYNC_KIND): the weight versions a rank holds between actions, at their peak over
# a stream past its fill (8 batches), against the calculator; 2BW's tied weight; PipeDream's p - s copies on pp=4.
ASYNC_KIND = "memory_harness:async_measured_run"
ASYNC = [Case(model=m, mesh=mesh, options=(("schedule", s), ("num_microbatches", mb)), kind=ASYNC_KIND, steps=8,
              overrides=over)
         for m, mesh, s, mb, over in [("llama_tiny", (1, 2, 1), "pipedream", 2, ()),
                                      ("gpt_tiny", (1, 2, 1), "pipedream_2bw", 2, ()),
                                      ("llama_tiny", (1, 2, 1), "pipemare", 2, ()),
                                      ("llama_tiny", (1, 4, 1), "pipedream", 4, (("num_layers", 4),)),
                                      ("gpt_tiny", (2, 2, 1), "pipedream_2bw", 2, ())]]
# bf16 under ZeRO-1/2/3 with Adam: after training, a checkpoint round trip (fp32 masters from their owners).
ROUND_TRIP = [c for c in MEMORY if c.mesh[0] == 4 and ("precision", "bf16") in c.options
              and dict(c.options)["zero_stage"] > 0]


def measured_run(case: Case, mesh) -> dict:
    """Train ``case`` like parallel_run, recording every rank's activations (step 1) and model states (end)."""
    import torch.distributed as dist

    import autopar
    from autopar.models import lm_loss
    from autopar.runtime.diagnostics.memory_probe import held_state_bytes, recording_activations

    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                              **dict(case.options))
    losses, norms, activations = [], [], {}
    for step, (idx, tgt) in enumerate(data):
        with recording_activations(program) as seen:
            losses.append(program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt)).item())
        activations = activations or dict(seen)
        norms.append(None if program.last_grad_norm is None else float(program.last_grad_norm))
    states = held_state_bytes(program)
    mine = {"rank": program.info.rank, "coords": dict(program.info.coords), "activations": activations,
            "states": states, "grad_norms": norms,
            "dtypes": sorted({str(p.dtype) for gm in program.graphs.values() for p in gm.parameters()})}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {"losses": losses, "state": program.full_state_dict(), "ranks": {r["rank"]: r for r in every},
           **replica_record(program)}
    if case in ROUND_TRIP:
        out["round_trip"] = _checkpoint_round_trip(program, data[0])
    return out


def _checkpoint_round_trip(program, batch) -> dict:
    """Save, take one more step, load: the fp32 masters come back exactly, every bf16 weight is their rounding."""
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    root = [tempfile.mkdtemp(prefix="autopar_bf16_zero_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    saved = program.full_state_dict()
    folder = program.save_checkpoint(root[0])
    idx, tgt = batch
    program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt))
    moved = max((program.full_state_dict()[k] - v).abs().max().item() for k, v in saved.items())
    program.load_checkpoint(folder)
    back = program.full_state_dict()
    values = dict(program.parameter_values())
    rounded = all(torch.equal(c, values[n].to(c.dtype).reshape(c.shape)) for n, c in program.mixed.compute.items())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rounded)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    return {"moved": moved, "max_change": max((back[k] - v).abs().max().item() for k, v in saved.items()),
            "rounded": every, "masters": {k: str(v.dtype) for k, v in back.items()}}


def async_measured_run(case: Case, mesh) -> dict:
    """Train an asynchronous ``case``; every rank's peak weight-version bytes between actions, and model states."""
    import torch.distributed as dist

    import autopar
    from autopar.models import lm_loss
    from autopar.runtime.diagnostics.memory_probe import held_state_bytes, weight_version_bytes

    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                              **dict(case.options))
    peak = [0]

    def measured(run):
        def action(*args):
            out = run(*args)
            peak[0] = max(peak[0], weight_version_bytes(program))
            return out
        return action

    program._forward, program._backward = measured(program._forward), measured(program._backward)
    for idx, tgt in data:
        program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt))
    mine = {"rank": program.info.rank, "weight_versions": peak[0], "states": held_state_bytes(program)}
    program.flush()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": {r["rank"]: r for r in every}}


@functools.lru_cache(maxsize=None)
def results(world: int) -> dict:
    """{case: rank 0's result} for every case of ``world`` ranks (one spawned group per session)."""
    cases = [c for c in ALL + ASYNC if c.world_size == world]
    return dict(zip(cases, run_cases(cases)))


def estimate(case: Case):
    """The memory calculator's per-rank figures for ``case`` (autopar.plan in this process).

    ZeRO-0/1/2 share their graphs and ZeRO-3 only adds gathers (whose weights are freed after use),
    so one plan per case without its ZeRO stage serves all four; the stage goes to the calculator.
    """
    from autopar.memory import estimate_memory

    options = dict(case.options)
    zero = options.pop("zero_stage", 1)
    options.pop("max_grad_norm", None)
    result = _plan(case.model, case.mesh, tuple(sorted(options.items())), case.overrides, case.cp)
    return estimate_memory(result, optimizer=OPTIMIZER_KIND[case.optimizer], zero_stage=zero)


@functools.lru_cache(maxsize=None)
def _plan(model_name: str, mesh: tuple, options: tuple, overrides: tuple = (), cp: int = 1):
    import autopar
    from autopar.models import lm_loss

    case = Case(model=model_name, mesh=mesh, options=options, kind=KIND, steps=2, overrides=overrides, cp=cp)
    model = build(case)
    x, y = batches(case, model.cfg.vocab_size)[0]
    shape = dict(zip(("dp", "pp", "tp"), mesh), cp=cp)
    return autopar.plan(model, shape, example_inputs=(x,), loss_fn=lm_loss, example_target=y, **dict(options))
