"""A runner for the equivalence harness that also reports data-parallel facts of the run.

Used as ``Case(kind="dp_probe:probe_run")``: it trains like ``parallel_run`` and
adds, per rank-0 view, the dp communication of the last step (bytes sent per purpose), the bytes
of parameters this rank holds, the measured model-state bytes, the optimizer's ownership, the
overlapped buckets' launches and the executor's action windows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def probe_run(case, mesh) -> dict:
    """``parallel_run`` plus comm audit, memory and overlap facts (gathered from every rank)."""
    import autopar
    from autopar.models import lm_loss
    from autopar.runtime.state.model_state import model_state_bytes
    from equivalence import batches, build, make_optimizer, replica_record
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case),
                              p2p_timeout_s=120, **dict(case.options))
    full_numel = {n: p.numel() for n, p in program.named_params}
    losses = []
    for idx, tgt in data:
        loss = program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt))
        losses.append(loss.item())
    mine = {
        "rank": program.info.rank,
        "coords": dict(program.info.coords),
        "comm": program.comm_log.by_purpose(),
        "sent": program.comm_log.sent_bytes(),
        "param_numels": full_numel,
        "memory": model_state_bytes(program),
        "owned": [n for n, p in program.named_params
                  if any(p is q for q in program.optimizer.owned_parameters())],
        # on the events' clock (their origin is the schedule's start); DataParallel has no buckets
        "launches": program.grad_sync.launch_log(origin=program.events[0].origin)
        if hasattr(program, "grad_sync") and program.events else [],
        "events": list(program.events),
        "num_microbatches": program.plan.pipeline.num_microbatches,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    state = program.full_state_dict()
    return {"losses": losses, "state": state, "ranks": everyone, "plan": program.plan.model_dump_json(),
            **replica_record(program)}


def dataparallel_infer_run(case, mesh) -> dict:
    """DataParallel inference: ``program(global batch)`` returns the whole batch's output on every rank."""
    import autopar
    from equivalence import batches, build
    from autopar.models import lm_loss
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              data_parallel="dataparallel")
    outputs = [program(program.shard_batch(idx)) for idx, _ in data]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outputs)
    return {"outputs": everyone}
