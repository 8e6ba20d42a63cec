"""Stage graphs built for another batch shape, made to share the compiled graphs' state.

The lowering of a new shape (:mod:`autopar.runtime.execution.shape_cache`) builds this rank's stage graphs
afresh, holding the model's tensors as the capture found them (meta tensors for a meta-built
model, the model's own values otherwise). :func:`graft` points every parameter, buffer and
constant of each new graph at the tensor of the same name in the compiled graph of its stage:
the same ``nn.Parameter`` objects, so gradients accumulate into the same ``.grad``, the DDP
bucket hooks fire, the optimizer (ZeRO shards and masters included) steps them, and checkpoints
see one set of weights. Their collectives are bound to the rank's groups and their send/recv
nodes to its channel; ZeRO-3 graphs get their gather runtime. A tensor the compiled graph does
not hold is an internal error: the two lowerings must name the same tensors.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.errors import PassError
from autopar.ops.collectives import bind_collectives
from autopar.ops.p2p import P2PNode
from autopar.ops.zero3_ops import bind_zero3

__all__ = ["graft"]


def _tensors(module: nn.Module):
    """(qualified name, owner module, attribute, tensor) of every parameter, buffer and tensor attribute."""
    for prefix, owner in module.named_modules():
        names = set(owner._parameters) | set(owner._buffers) | {
            k for k, v in vars(owner).items() if isinstance(v, torch.Tensor)}
        for attr in sorted(names):
            value = getattr(owner, attr, None)
            if isinstance(value, torch.Tensor):
                yield (f"{prefix}.{attr}" if prefix else attr), owner, attr, value


def _graft_stage(new, old) -> None:
    held = {name: value for name, _, _, value in _tensors(old.gm)}
    for name, owner, attr, value in list(_tensors(new.gm)):
        if name not in held:
            if value.is_meta or isinstance(value, nn.Parameter):
                raise PassError(f"the graphs built for a new batch shape hold {name}, which the compiled stage "
                                f"{old.stage} does not", where=f"stage {old.stage}",
                                fix="this is a bug in autopar; compile with dynamic_shapes='static' to avoid it, "
                                    "or pass batches of the compiled shapes")
            continue
        if attr in owner._parameters:
            owner._parameters[attr] = held[name]
        elif attr in owner._buffers:
            owner._buffers[attr] = held[name]
        else:
            setattr(owner, attr, held[name])


def graft(stages: list, *, base: dict, ctx, channel) -> tuple[dict, tuple]:
    """({stage: graph} of this rank's ``stages`` sharing ``base``'s tensors and bound to the rank, their
    ZeRO-3 runtimes)."""
    mine = {s.stage: s for s in stages if s.stage in base}
    runtimes = []
    for index, stage in mine.items():
        _graft_stage(stage, base[index])
        bind_collectives(stage.gm, ctx.info.groups, ctx.guard)
        for module in stage.gm.modules():
            if isinstance(module, P2PNode):
                module.bind(channel)
        runtime = bind_zero3(stage.gm, comm_log=ctx.comm_log)
        if runtime is not None:
            runtimes.append(runtime)
    return mine, tuple(runtimes)
