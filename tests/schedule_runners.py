"""Runner kinds for the schedule tests, run inside tests/equivalence.py's spawned groups.

``Case(kind="schedule_runners:async_run", ...)`` trains an asynchronous schedule on real text and
brings back what the single-process emulation needs to replay it; ``trace_run`` times a few
steps and gathers every rank's events for the measured-versus-simulated bubble.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
import torch.distributed as dist

from equivalence import Case, build, make_optimizer, replica_record, run_cases

__all__ = ["text_batches", "async_run", "trace_run", "layout_of", "SYNC_CASES", "INFER_CASES", "ASYNC_CASES",
           "TRACE_CASE", "CRITICAL_PATH_CASES", "results"]


def text_batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``case.steps`` batches of the character corpus (real text, so the loss can fall)."""
    from autopar.models import TextBatches
    from equivalence import pad_targets
    it = iter(TextBatches(seq_len=case.seq, batch_size=case.batch, seed=7))
    batches = [next(it) for _ in range(case.steps)]
    if dict(case.extra).get("padded_targets"):  # (equivalence.pad_targets)
        batches = [(x, pad_targets(y.clone())) for x, y in batches]
    return batches


def layout_of(program) -> dict:
    """{user parameter name: stages holding it} over every rank, and the stage starts."""
    from autopar.lowering import user_name
    mine = {user_name(t): s.stage for s in program.stages.values() for t in s.param_names}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    stages: dict[str, set[int]] = {}
    for part in gathered:
        for name, stage in part.items():
            stages.setdefault(name, set()).add(stage)
    return {"param_stages": {k: tuple(sorted(v)) for k, v in stages.items()},
            "stage_starts": tuple(program.plan.pipeline.stage_starts)}


def _compile(case: Case, mesh, data):
    import autopar
    from autopar.models import lm_loss
    options = {"p2p_timeout_s": 120, **dict(case.options)}
    return autopar.compile(build(case), mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                           example_target=data[0][1], optimizer=make_optimizer(case), **options)


def async_run(case: Case, mesh) -> dict:
    """Feed ``case.steps`` batches into an asynchronous pipeline, then flush; losses, weights, layout."""
    data = text_batches(case)
    program = _compile(case, mesh, data)
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    state = program.full_state_dict()  # flushes first
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, program.peak_versions)
    return {"losses": losses, "state": state, "data": data, "layout": layout_of(program),
            "rule": program.rule, "num_microbatches": program.plan.pipeline.num_microbatches,
            "peak_versions": peaks, **replica_record(program)}


def trace_run(case: Case, mesh) -> dict:
    """Train ``case.steps`` steps; every step's events from every rank, lined up (runtime/execution/trace.py)."""
    from autopar.runtime.execution.trace import gather_events
    data = text_batches(case)
    program = _compile(case, mesh, data)
    steps = []
    for x, y in data:
        dist.barrier()
        program.train_step(program.shard_batch(x), target=program.shard_batch(y))
        steps.append(gather_events(program))
    return {"steps": steps, "schedule": program.schedule}


# -- every spawned case of the schedule tests, run in one group per world size --------------------
def _case(model, mesh, schedule, m, *, layers=None, kind="train", steps=3, **options):
    overrides = (("num_layers", layers),) if layers else ()
    return Case(model=model, mesh=mesh, kind=kind, steps=steps, overrides=overrides,
                options=(("schedule", schedule), ("num_microbatches", m)) + tuple(options.items()))


#: synchronous schedules against one device: p in {2, 4}, both models, several m, with dp and tp
SYNC_CASES = [
    _case("gpt_tiny", (1, 2, 1), "naive", 2),
    _case("llama_tiny", (1, 2, 1), "interleaved_1f1b", 4, layers=4),
    _case("gpt_tiny", (1, 2, 1), "looped_bfs", 2, layers=4, num_virtual=3),
    _case("llama_tiny", (1, 2, 1), "zb_h1", 2),
    _case("gpt_tiny", (1, 2, 1), "zb_h2", 4),
    _case("llama_tiny", (1, 2, 1), "zb_v", 2),
    _case("gpt_tiny", (1, 2, 1), "chimera", 2),
    _case("gpt_tiny", (1, 2, 1), "chimera", 2, recompute="full"),  # recompute on both replicas' stage graphs
    _case("gpt_tiny", (1, 4, 1), "interleaved_1f1b", 4, layers=6),
    _case("llama_tiny", (1, 4, 1), "zb_v", 4, layers=6),
    _case("llama_tiny", (1, 4, 1), "chimera", 4),
    _case("gpt_tiny", (2, 2, 1), "looped_bfs", 2, layers=4),
    _case("gpt_tiny", (1, 2, 2), "zb_v", 4),
    _case("llama_tiny", (1, 2, 2), "interleaved_1f1b", 4, layers=4),  # several stages per rank, with tp
    _case("gpt_tiny", (1, 2, 2), "looped_bfs", 2, layers=4),
    _case("llama_tiny", (2, 2, 1), "chimera", 2),
    _case("llama_tiny", (1, 2, 1), "dualpipev", 4),
    _case("gpt_tiny", (1, 4, 1), "dualpipev", 8, layers=6),
    _case("gpt_tiny", (1, 2, 1), "dualpipe", 4),
    _case("llama_tiny", (1, 4, 1), "dualpipe", 8, layers=4),
]
#: forward-only inference through the forward_only schedule of a multi-stage placement
INFER_CASES = [_case("llama_tiny", (1, 2, 1), "chimera", 2, kind="infer"),
               _case("gpt_tiny", (1, 2, 1), "zb_v", 4, kind="infer")]
#: asynchronous schedules against the single-process emulation of their staleness rule
ASYNC_CASES = [
    _case("llama_tiny", (1, 2, 1), "pipedream", 2, kind="schedule_runners:async_run", steps=4),
    _case("gpt_tiny", (1, 2, 1), "pipedream_2bw", 2, kind="schedule_runners:async_run", steps=4),
    _case("llama_tiny", (1, 2, 1), "pipemare", 2, kind="schedule_runners:async_run", steps=4,
          pipemare_lr_warmup_updates=4),
    _case("gpt_tiny", (2, 2, 1), "pipedream_2bw", 2, kind="schedule_runners:async_run", steps=3),  # dp, tied
    # max_grad_norm under 2BW: each batch's update clipped by the global norm of its gradient over every stage
    # and dp rank (PipeDream and PipeMare refuse it: docs/schedules.md)
    _case("gpt_tiny", (1, 2, 1), "pipedream_2bw", 2, kind="schedule_runners:async_run", steps=4, max_grad_norm=0.5),
    _case("gpt_tiny", (2, 2, 1), "pipedream_2bw", 2, kind="schedule_runners:async_run", steps=3, max_grad_norm=0.5),
] + [dataclasses.replace(c, extra=(("padded_targets", True),)) for c in [  # token-mean weights per update
    # (an update of one microbatch on one dp rank is its own token mean: dp=2, or 2BW's updates of m)
    _case("gpt_tiny", (1, 2, 1), "pipedream_2bw", 4, kind="schedule_runners:async_run", steps=3),
    _case("llama_tiny", (2, 2, 1), "pipedream", 2, kind="schedule_runners:async_run", steps=3),
    _case("llama_tiny", (2, 2, 1), "pipemare", 2, kind="schedule_runners:async_run", steps=3),
    _case("gpt_tiny", (2, 2, 1), "pipedream_2bw", 2, kind="schedule_runners:async_run", steps=3)]]
#: the measured-versus-simulated bubble at p=2: a model heavy enough that actions outweigh overheads
TRACE_CASE = Case(model="gpt_tiny", mesh=(1, 2, 1), kind="schedule_runners:trace_run", steps=6, batch=16, seq=64,
                  optimizer="adam", options=(("schedule", "1f1b"), ("num_microbatches", 4)),
                  overrides=(("hidden", 128), ("num_layers", 4)))
#: a transformers model's dict batches on its own loss under PipeDream (an update per microbatch: the label
#: tokens are counted per update), against positional inputs with the same loss written as a loss_fn
ASYNC_DICT_CASES = [Case(model="llama", mesh=(1, 2, 1), kind="hf_runners:own_loss_against_loss_fn", steps=3,
                         options=(("schedule", "pipedream"), ("num_microbatches", 2)))]
if importlib.util.find_spec("transformers") is None:  # the [test] extra installs it
    ASYNC_DICT_CASES = []
#: a measured step's own critical path (runtime/execution/trace.py measured_critical_path): 1F1B and ZB-V on pp=2
CRITICAL_PATH_CASES = [_case("gpt_tiny", (1, 2, 1), "1f1b", 4, kind="schedule_runners:trace_run", steps=2),
                       _case("gpt_tiny", (1, 2, 1), "zb_v", 4, layers=4, kind="schedule_runners:trace_run", steps=2)]
ALL_CASES = (SYNC_CASES + INFER_CASES + ASYNC_CASES + ASYNC_DICT_CASES
             + CRITICAL_PATH_CASES)  # TRACE_CASE runs alone (its timing test)


@functools.lru_cache(maxsize=None)
def results(world: int) -> dict:
    """Every case of ``world`` ranks, run once per pytest session in one spawned group."""
    cases = [c for c in ALL_CASES if c.world_size == world]
    return dict(zip(cases, run_cases(cases)))
