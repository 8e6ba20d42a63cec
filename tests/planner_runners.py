"""Runners for the planner's spawned tests (``Case.kind = "planner_runners:<function>"``).

- :func:`rebalance_run`: compile with a deliberately bad stage split, train, let the
  :class:`~autopar.planner.rebalance.LoadBalancer` propose and apply a better one at a step
  boundary, train on; the losses and final weights are judged against one device.
- :func:`auto_run`: ``autopar.compile(..., plan="auto")`` on the given mesh (or with ``mesh=None``,
  the planner choosing the degrees), trained like the harness's ``train`` kind.
"""
from __future__ import annotations

import torch

from equivalence import batches, build, make_optimizer, replica_record


def rebalance_run(case, mesh) -> dict:
    import autopar
    from autopar.models import lm_loss
    from autopar.plan_model import MeshShape, PipelinePlan, Plan
    from autopar.planner.rebalance import LoadBalancer

    extra = dict(case.extra)
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    dp, pp, tp = case.mesh
    bad = Plan(global_batch_size=case.batch, mesh=MeshShape(dp=dp, pp=pp, tp=tp),
               pipeline=PipelinePlan(schedule=extra.get("schedule", "1f1b"), num_microbatches=extra.get("m", 2),
                                     stage_starts=tuple(extra["bad_starts"])))
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              optimizer=make_optimizer(case), plan=bad, p2p_timeout_s=120)
    balancer = LoadBalancer(program)
    losses, proposal = [], None
    for i, (idx, tgt) in enumerate(data):
        if i == extra["switch_at"]:
            proposal = balancer.propose()
            program = balancer.apply(proposal)
        losses.append(program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt)).item())
        balancer.observe()
    return {"losses": losses, "state": program.full_state_dict(), "proposal": proposal.stage_starts,
            "before": tuple(bad.pipeline.stage_starts), "after": tuple(program.plan.pipeline.stage_starts),
            "stage_seconds": proposal.stage_seconds, "step_count": program.step_count, **replica_record(program)}


def auto_run(case, mesh) -> dict:
    import autopar
    from autopar.models import lm_loss

    extra = dict(case.extra)
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, None if extra.get("no_mesh") else mesh, example_inputs=(data[0][0],),
                              loss_fn=lm_loss, example_target=data[0][1], optimizer=make_optimizer(case),
                              plan="auto", cluster=extra.get("cluster", "cpu-2core"), p2p_timeout_s=120,
                              **dict(case.options))
    losses = [program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt)).item()
              for idx, tgt in data]
    return {"losses": losses, "state": program.full_state_dict(), "plan": program.plan.model_dump_json(),
            "table": program.planner.table(), **replica_record(program)}


def calibration_run(case, mesh) -> dict:
    """Every rank measures at once, as calibrate() does: compute, collectives and the switch time."""
    import torch.distributed as dist

    from autopar.planner.calibrate import (calibrated_cluster, combine, measure_collectives, measure_compute,
                                           measure_switch)

    figures = measure_compute(repeats=2)
    figures.update(measure_collectives(repeats=2, sizes=(2**12, 2**20)))
    figures["switch_s"] = measure_switch(actions=8, repeats=2, action_s=0.005)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    return {"figures": gathered, "cluster": calibrated_cluster(combine(gathered, len(gathered)))}


__all__ = ["rebalance_run", "auto_run", "calibration_run", "torch"]
