"""Runner kind for the held-storage soak test, run inside tests/equivalence.py's spawned groups.

``Case(kind="soak_runners:held", extra=(("at", (20, 60)), ...))`` trains ``max(at)`` steps on a few
batches used in turn and, after each step listed in ``at``, counts on every rank what the process holds
alive (:func:`autopar.runtime.diagnostics.memory_probe.live_storages`: tensor storages, their bytes, and the garbage
collector's objects). A program that keeps anything per step or per microbatch holds more at the later
count; one that holds steady holds exactly the same. ``("save_every", k)`` also saves a checkpoint every
``k`` steps (under a temporary root).
"""
from __future__ import annotations

from equivalence import Case, batches, build, make_optimizer

__all__ = ["KIND", "held", "soak_case", "SOAK_CASES", "SOAK_CASES_FOUR"]

KIND = "soak_runners:held"
AT = (10, 20, 60)  # the first census (step 10) warms up what counting itself creates once


def _compile(case: Case, mesh):
    """(program, the batches) of ``case``: an LM of autopar.models, or an MoE model of models/moe.py."""
    import autopar
    if case.model in ("switch", "deepseek"):
        from autopar.models.moe import moe_loss
        from moe_runners import batches as moe_batches
        from moe_runners import build as moe_build
        model, data, loss_fn = moe_build(case), moe_batches(case), moe_loss
    else:
        from autopar.models import lm_loss
        model = build(case)
        data, loss_fn = batches(case, model.cfg.vocab_size), lm_loss
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=loss_fn,
                              example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                              **dict(case.options))
    return program, data


def held(case: Case, mesh) -> dict:
    """Train; every rank's census after each step of ``at`` (``{"ranks": {rank: {"census": {step: (storages,
    bytes, objects)}, "freed": whether the program was collected once dropped}}}``).

    The census's own results go into a list of ints made beforehand (ints are not objects the collector
    tracks), so recording one count changes no later one."""
    import gc
    import os
    import shutil
    import tempfile
    import weakref

    import torch.distributed as dist

    from autopar.runtime.diagnostics.memory_probe import live_storages

    extra = dict(case.extra)
    at, save_every = tuple(extra.get("at", AT)), extra.get("save_every")
    program, data = _compile(case, mesh)
    root = [tempfile.mkdtemp(prefix="autopar_soak_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    slots = [0] * (3 * len(at))
    try:
        for step in range(1, max(at) + 1):
            idx, tgt = data[step % len(data)]
            program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt))
            if save_every and step % save_every == 0:
                program.save_checkpoint(os.path.join(root[0], "ckpt"))
            if step in at:
                k = 3 * at.index(step)
                slots[k:k + 3] = _settled_census(live_storages)
        program.flush()  # an asynchronous pipeline's last backwards and sends, before the group moves on
        dropped = weakref.ref(program)
        del program
        gc.collect()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root[0], ignore_errors=True)
    mine = {"census": {step: tuple(slots[3 * k:3 * k + 3]) for k, step in enumerate(at)},
            "freed": dropped() is None}  # nothing keeps a dropped program (and all it holds) alive
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": dict(enumerate(every))}


def _settled_census(census, attempts: int = 5) -> tuple[int, int, int]:
    """(storages, bytes, objects) once two counts in a row agree on the storages and bytes.

    A collective's worker thread (gloo's) may still hold the tensor of a collective that has completed, and
    drops it only once it gets the interpreter lock: a count taken meanwhile sees one tensor more (seen: a
    4-byte flag on one rank of one run in many). Between two counts this thread lets others run."""
    import time

    before = census()
    for _ in range(attempts):
        time.sleep(0)  # yields the interpreter lock (no clock is read)
        now = census()
        if (now.count, now.nbytes) == (before.count, before.nbytes):
            break
        before = now
    return now.count, now.nbytes, now.objects


def soak_case(model: str, mesh: tuple, **options) -> Case:
    """A held-storage case: a small model, small batches, the census after steps 20 and 60."""
    extra = (("at", AT),) + ((("save_every", options.pop("save_every")),) if "save_every" in options else ())
    return Case(model=model, mesh=mesh, kind=KIND, options=tuple(options.items()), batch=8, seq=8, steps=4,
                extra=extra, overrides=(("num_layers", 4),) if model not in ("switch", "deepseek") else ())


#: every schedule family (synchronous 1F1B and GPipe, split backward ZB-V, DualPipeV, Chimera, each
#: asynchronous one), DDP, ZeRO-1/2/3, tp, ep and a checkpoint saved every 10 steps, on two ranks
SOAK_CASES = [
    soak_case("gpt_tiny", (1, 2, 1), schedule="1f1b", num_microbatches=2),
    soak_case("llama_tiny", (1, 2, 1), schedule="zb_v", num_microbatches=2),
    soak_case("llama_tiny", (1, 2, 1), schedule="dualpipev", num_microbatches=4),
    soak_case("gpt_tiny", (1, 2, 1), schedule="chimera", num_microbatches=2),
    soak_case("llama_tiny", (1, 2, 1), schedule="pipedream", num_microbatches=2),
    soak_case("gpt_tiny", (1, 2, 1), schedule="pipedream_2bw", num_microbatches=2),
    soak_case("llama_tiny", (1, 2, 1), schedule="pipemare", num_microbatches=2),
    soak_case("gpt_tiny", (2, 1, 1), zero_stage=0),
    soak_case("gpt_tiny", (2, 1, 1), zero_stage=1),
    soak_case("gpt_tiny", (2, 1, 1), zero_stage=2),
    soak_case("gpt_tiny", (2, 1, 1), zero_stage=3),
    soak_case("gpt_tiny", (1, 1, 2)),
    soak_case("switch", (2, 1, 1), expert_parallel=2),
    soak_case("gpt_tiny", (1, 2, 1), schedule="gpipe", num_microbatches=2, save_every=10),
]
#: four ranks (slow): the asynchronous schedules' middle stages send both ways; 2BW with a weight tied over dp x pp
SOAK_CASES_FOUR = [
    soak_case("llama_tiny", (1, 4, 1), schedule="pipedream", num_microbatches=2),
    soak_case("llama_tiny", (1, 4, 1), schedule="pipedream_2bw", num_microbatches=4),
    soak_case("llama_tiny", (1, 4, 1), schedule="pipemare", num_microbatches=2),
    soak_case("gpt_tiny", (2, 2, 1), schedule="pipedream_2bw", num_microbatches=2),
    soak_case("gpt_tiny", (1, 2, 2), schedule="zb_v", num_microbatches=4, zero_stage=1),
]
