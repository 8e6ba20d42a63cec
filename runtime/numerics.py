"""Catch a NaN or inf in a training step before the optimizer applies it.

After backward and gradient synchronisation, and before the optimizer steps, every rank checks its
last-stage losses and its gradients; one one-element all-reduce over the world tells every rank
whether any found a non-finite value. If one did, every rank raises
:class:`autopar.errors.NumericsError` naming the step, the stage, the rank and the tensor, so no
rank waits in vain and the weights stay those of the last good step (a checkpoint can still be
saved, or the step retried with other data or a lower learning rate).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import NumericsError
from autopar.lowering import user_name

__all__ = ["local_nonfinite", "check_finite"]


def _loss_of(result) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def local_nonfinite(program, results: dict) -> str | None:
    """What this rank found non-finite (the first loss, else the first gradient), or None."""
    last = max(program.stages) if program.stages else None
    for microbatch in sorted(results):
        loss = _loss_of(results[microbatch])
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            return f"the loss of microbatch {microbatch} is {loss.detach().reshape(-1)[0].item()} (stage {last})"
    stage_of = {user_name(t): s for s, st in sorted(program.stages.items()) for t in st.param_names}
    for name, p in program.named_params:
        if p.grad is not None and not torch.isfinite(p.grad).all():
            bad = p.grad[~torch.isfinite(p.grad)].reshape(-1)[0].item()
            return f"the gradient of {name} holds {bad} (stage {stage_of.get(name, '?')})"
    return None


def check_finite(program, results: dict) -> None:
    """Raise NumericsError on every rank if any rank's loss or gradients hold a NaN or inf."""
    found = local_nonfinite(program, results)
    step = program.step_count + 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if found is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, found)
    elif found is None:
        return
    else:
        reports = [found]
    # a non-finite loss explains the gradients: report it first
    rank, what = min(((r, f) for r, f in enumerate(reports) if f is not None),
                     key=lambda rf: (not rf[1].startswith("the loss"), rf[0]))
    others = sum(f is not None for f in reports) - 1
    raise NumericsError(
        f"non-finite value at training step {step}: {what}" + (f"; {others} other rank(s) too" if others else ""),
        where=f"rank {rank}, step {step}",
        fix="the optimizer did not step, the weights are those of step "
            f"{step - 1}: check the batch for NaN/inf, lower the learning rate, clip gradients "
            "(max_grad_norm=...), or use precision='fp32' where bf16 overflows")
