"""Context parallelism in the runtime: this rank's part of each sequence, and forward outputs whole again.

The lowering (passes/context_parallel/cp_shard.py) records in the Plan which graph inputs carry the sequence
(``plan.cp_inputs``: name and dim) and its whole length (``plan.cp_seq_len``). A rank is handed its dp slice
with whole sequences; :func:`cut_sequence` keeps the positions of its cp coordinate
(:class:`~autopar.ops.context_parallel.layout.CpLayout`: load-balanced, chunks i and 2cp-1-i), and
:func:`join_sequence` all-gathers a forward-only output's shards over cp and puts them back in sequence
order. What else crosses cp ranks is the dp x cp group's (``dcp``): the token counts of the loss and the
weights' gradients, summed as over dp (runtime/execution/step_batches.py, runtime/state/grad_sync.py).

    >>> from autopar.plan_model import MeshShape, Plan
    >>> plan = Plan(mesh=MeshShape(cp=2), global_batch_size=2, cp_inputs=(("idx", 1),), cp_seq_len=8)
    >>> x = torch.arange(16).view(2, 8)
    >>> cut_sequence((x,), ("idx",), plan=plan, rank=1, where="here")[0][0].tolist()
    [2, 3, 4, 5]
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopar.errors import PlanError
from autopar.ops.context_parallel.layout import CpLayout

__all__ = ["cut_sequence", "join_sequence", "layout_of", "shifted", "item_count_of"]


def layout_of(plan) -> CpLayout:
    """The Plan's cut of its sequence over cp."""
    return CpLayout(seq_len=plan.cp_seq_len, cp=plan.mesh.cp, load_balanced=plan.cp_load_balanced)


def cut_sequence(tensors: tuple, names: tuple[str, ...], *, plan, rank: int, where: str) -> tuple:
    """``tensors`` (the graph's inputs by ``names``) with each sequence input cut to cp rank ``rank``'s part;
    an input already holding the local length passes as it is."""
    if plan.mesh.cp == 1 or not plan.cp_inputs:
        return tuple(tensors)
    layout, dims = layout_of(plan), dict(plan.cp_inputs)
    shifts = {name: (k, fill) for name, k, fill in plan.cp_label_shifts}
    out = []
    for name, tensor in zip(names, tensors):
        dim = dims.get(name)
        if dim is None or not isinstance(tensor, torch.Tensor) or (
                tensor.shape[dim] == layout.local_len and name not in shifts):
            out.append(tensor)
            continue
        if tensor.shape[dim] != layout.seq_len:
            raise PlanError(f"input {name!r} holds {tensor.shape[dim]} positions on dim {dim}; this program cuts "
                            f"sequences of {layout.seq_len} over cp={layout.cp}", where=where,
                            fix=f"pad every sequence to {layout.seq_len} tokens (labels -100, attention_mask 0), or "
                                "compile on a batch of the length you train on")
        if name in shifts:  # the model shifts these inside its loss: shifted whole, then cut
            tensor = shifted(tensor, dim=dim, k=shifts[name][0], fill=shifts[name][1])
        out.append(layout.shard(tensor, dim=dim, rank=rank))
    return tuple(out) + tuple(tensors[len(names):])


def shifted(tensor: torch.Tensor, *, dim: int, k: int, fill: float) -> torch.Tensor:
    """``tensor`` moved ``k`` positions left along ``dim``, the last ``k`` set to ``fill`` (what
    ``pad(t, (0, k), value=fill)[..., k:]`` makes)."""
    tail = torch.full_like(tensor.narrow(dim, 0, k), fill)
    return torch.cat([tensor.narrow(dim, k, tensor.shape[dim] - k), tail], dim=dim)


def item_count_of(spec, plan):
    """The step's label count as the graph reads it: labels the runtime shifted count from position 0."""
    if spec is not None and any(name == spec.labels for name, _, _ in plan.cp_label_shifts):
        return dataclasses.replace(spec, shift=0)
    return spec


def join_sequence(outputs, *, plan, group, guard=None):
    """Every tensor of ``outputs`` holding the local length on dim 1, gathered over cp in sequence order."""
    if plan.mesh.cp == 1 or not plan.cp_inputs:
        return outputs
    layout = layout_of(plan)

    def whole(t):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != layout.local_len:
            return t
        pieces = [torch.empty_like(t) for _ in range(layout.cp)]
        if guard is None:
            dist.all_gather(pieces, t.contiguous(), group=group)
        else:
            guard.run("all_gather", dist.all_gather, pieces, t.contiguous(), group=group,
                       purpose="the forward's outputs over cp")
        return layout.join(pieces, dim=1)

    return pytree.tree_map(whole, outputs)
