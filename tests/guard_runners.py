"""Runner kinds for the run-time guards (``kind="guard_runners:<function>"`` in an :class:`equivalence.Case`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from equivalence import batches, build, make_optimizer


def index_out_of_range(case, mesh) -> dict:
    """One rank (global rank 1: pp 0, tp 1) feeds a token id past the embedding; every rank must raise the
    same IndexRangeError (none left waiting on its peers), the step must not be taken, and the group must
    stay usable: a good step afterwards trains on every rank."""
    import autopar
    from autopar.models import lm_loss

    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              optimizer=make_optimizer(case), p2p_timeout_s=60, **dict(case.options))
    x, y = (program.shard_batch(t) for t in data[0])
    program.train_step(x, target=y)
    bad = x.clone()
    if dist.get_rank() == 1:
        bad[-1, 3] = model.cfg.vocab_size + 5
    before = program.full_state_dict()
    try:
        program.train_step(bad, target=y)
        message = ""
    except autopar.AutoparError as exc:
        message = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(v, program.full_state_dict()[k]) for k, v in before.items())
    step_count = program.step_count
    loss = program.train_step(x, target=y).item()  # the group is still usable
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (message, unchanged, step_count, loss))
    return {"messages": [m for m, *_ in everything], "unchanged": [u for _, u, *_ in everything],
            "step_counts": [s for *_, s, _ in everything], "losses": [v for *_, v in everything]}
