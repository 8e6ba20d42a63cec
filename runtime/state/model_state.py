"""Measured model-state memory of one rank: the bytes of tensor storage it actually holds.

:func:`model_state_bytes` counts every distinct storage reachable from the program's
parameters, their gradients and the optimizer's state, once each (gradients that are views
into one flat DDP bucket count as that bucket). Call it after ``train_step``: then the
gradients of the step are still held, as they are when the optimizer runs. ZeRO's theory for
Ψ parameters on N dp ranks, with K bytes of optimizer state per parameter, in fp32:

=========  ============  ============  ============
stage      parameters    gradients     optimizer
=========  ============  ============  ============
DDP        4Ψ            4Ψ            KΨ
ZeRO-1     4Ψ            4Ψ            KΨ/N
ZeRO-2     4Ψ            4Ψ/N          KΨ/N
ZeRO-3     4Ψ/N          4Ψ/N          KΨ/N
=========  ============  ============  ============

(K = 4 for SGD with momentum, 8 for Adam.) ZeRO-1/2 own whole parameters, so a rank's share is
the one :func:`autopar.runtime.state.zero.partition_params` gives it, close to but not exactly 1/N;
ZeRO-3's flat shards are exactly 1/N of each parameter rounded up to a multiple of N.
"""
from __future__ import annotations

import torch

__all__ = ["model_state_bytes", "storage_bytes"]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_bytes(program) -> dict[str, int]:
    """{"params", "grads", "optimizer", "master", "total"}: bytes this rank holds (call after ``train_step``).

    ``master`` counts parameters the optimizer steps that are not the program's own (fp32 master
    copies under mixed precision); 0 in fp32.
    """
    params = [p for _, p in program.named_params]
    mine = {id(p) for p in params}
    opt = program.optimizer.optimizer
    state = [v for s in opt.state.values() for v in s.values()] if opt is not None else []
    masters = [p for g in opt.param_groups for p in g["params"] if id(p) not in mine] if opt is not None else []
    sizes = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(state),
        "master": storage_bytes(masters) + storage_bytes(p.grad for p in masters),
    }
    sizes["total"] = sum(sizes.values())
    return sizes
