"""The model's tensors no stage graph reads: kept on every rank, never trained, in and out with the weights.

A model may hold parameters and persistent buffers its forward never reads: CLIP's vision
``post_layernorm`` under a loss on ``last_hidden_state``, a pooler, a spare head, a statistic
buffer. On one device they get no gradient, the optimizer leaves them as they are, and
``model.state_dict()`` still has them. The capture records only what the forward reads, so no
stage graph holds them: without this module the program would drop them from
``full_state_dict()``, from checkpoints, and from a pretrained load.

:func:`keep_unused` finds them (the model's ``state_dict`` entries that no get_attr node of any
stage graph names, under any of its names) and keeps one whole copy on every rank: no pass saw
them, so none cuts them. A meta-built model's are filled by the same filler as its stage tensors
(``runtime/state/materialize.py``: the model's initialisers, or a pretrained loader). The program lists
them with its buffers (``runtime/state/rank_tensors.held_tensors``, kind ``"buffer"``: no optimizer
state), so ``full_state_dict``, ``load_full_state_dict`` and checkpoints carry them like any
replicated buffer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.ir.graph_names import user_name
from autopar.ir.meta_keys import PARAM, get_meta
from autopar.runtime.checkpoints.checkpoint_layout import Layout
from autopar.runtime.state.materialize import Filler, Slot

__all__ = ["UnusedTensor", "graph_read_names", "find_unused", "keep_unused"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnusedTensor:
    """One tensor of the model that no stage graph reads, as this rank keeps it."""

    name: str  # the first of its single-device names (state_dict order)
    aliases: tuple[str, ...]  # every single-device name of the tensor (ties), ``name`` first
    tensor: torch.Tensor
    kind: str  # "param" | "buffer" (as the model holds it; the program keeps both as buffers)


def graph_read_names(stages) -> set[str]:
    """Every single-device name (ties included) that a get_attr node of one of ``stages`` reads."""
    names: set[str] = set()
    for stage in stages:
        for node in stage.gm.graph.nodes:
            if node.op != "get_attr":
                continue
            names.add(user_name(node.target))
            info = get_meta(node, PARAM)
            if info is not None:
                names.update(user_name(a) for a in info.aliases)
    return names


def find_unused(model: nn.Module, stages) -> list[tuple[tuple[str, ...], torch.Tensor, str]]:
    """(names, tensor, kind) of each ``state_dict`` tensor of ``model`` that none of ``stages`` reads."""
    read = graph_read_names(stages)
    params = {id(p) for p in model.parameters()}
    by_tensor: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            by_tensor.setdefault(id(tensor), ([], tensor))[0].append(name)
    return [(tuple(names), tensor, "param" if id(tensor) in params else "buffer")
            for names, tensor in by_tensor.values() if not read.intersection(names)]


def keep_unused(model: nn.Module, stages, *, fill: Filler | None, device: torch.device) -> tuple[UnusedTensor, ...]:
    """This rank's copy of every tensor of ``model`` that no stage graph reads.

    ``stages``: every stage of the lowering (all ranks'), so that a tensor another rank's stage
    reads is not kept here; ``fill``: the meta-built model's filler (None: real tensors, copied).
    """
    found = find_unused(model, stages)
    if not found:
        return ()
    real = [(names, t, kind) for names, t, kind in found if not t.is_meta]
    meta = [(names, t, kind) for names, t, kind in found if t.is_meta]
    kept = [UnusedTensor(names[0], names, t.detach().to(device, copy=True), kind) for names, t, kind in real]
    if meta:
        slots = [Slot(name=names[0], aliases=names, layout=Layout(shape=tuple(t.shape)), tp_index=0, z_index=0,
                      dtype=t.dtype, kind=kind) for names, t, kind in meta]
        pieces = fill(slots)
        kept += [UnusedTensor(s.name, s.aliases, pieces[s.name].detach().to(device), s.kind) for s in slots]
    total = sum(u.tensor.numel() * u.tensor.element_size() for u in kept)
    log.info("%d tensors of the model are read by no stage graph (%s%s, %.2f MB): kept whole on every rank, "
             "not trained, saved and loaded with the weights", len(kept), ", ".join(u.name for u in kept[:4]),
             ", ..." if len(kept) > 4 else "", total / 1e6)
    return tuple(kept)
