"""A rank's tensors made real: each rank allocates only what it holds of a meta-built model.

A model built under ``torch.device("meta")`` is planned and lowered without storage; its stage
graphs hold meta tensors, cut as the rank will hold them (tensor-parallel shards, its stages only,
ZeRO-3's flat block). :func:`materialize_rank` replaces every one of them by a real tensor of the
rank's own piece, which a **filler** provides:

``fill(slots: list[Slot]) -> dict[str, torch.Tensor]``
    one local tensor per ``slot.name``, of ``slot.layout.piece_shape()`` and ``slot.dtype``: the
    piece ``checkpoint_layout.split(full, slot.layout, tp_index=slot.tp_index, z_index=slot.z_index,
    ep_index=slot.ep_index)`` of the single-device tensor named ``slot.name`` (any of ``slot.aliases``
    in the model). A mixture-of-experts expert tensor split over ep ranks (``plan.expert_params``)
    has ``layout.ep`` set: the rank's piece is its experts' block of dim 0 (then its tp cut).

Two fillers share this contract: :func:`autopar.runtime.execution.init_replay.init_filler` (the model's own
initialisers, replayed one module at a time) and a pretrained loader that reads only the slices a
rank holds from a checkpoint. Ties are kept: one tensor read under two names (a tied embedding and
LM head) becomes one real tensor. In use (``autopar.compile`` does this on every rank)::

    slots = rank_slots(gms, plan=plan, coords={"dp": 0, "pp": 1, "tp": 0})
    materialize_rank(gms, plan=plan, coords=coords, fill=init_filler(model, seed=0), device="cpu")
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.errors import PlanError
from autopar.ir.graph_names import MODEL_PREFIX
from autopar.ir.meta_keys import PARAM, get_meta
from autopar.runtime.checkpoints.checkpoint_layout import Layout

__all__ = ["Slot", "Filler", "rank_slots", "materialize_rank", "held_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """One tensor a rank holds of the single-device model, still to be filled."""

    name: str  # single-device name (the model's own, without autopar's ``model.`` prefix)
    aliases: tuple[str, ...]  # every single-device name of the same tensor (ties), ``name`` included
    layout: Layout  # how the rank's piece is cut from the single-device tensor
    tp_index: int
    z_index: int
    dtype: torch.dtype
    kind: str  # "param" | "buffer"
    requires_grad: bool = False
    ep_index: int = 0  # this rank's block of an expert tensor split over ep (``layout.ep``)


Filler = Callable[[list[Slot]], dict[str, torch.Tensor]]


def _user_name(target: str) -> str:
    prefix = MODEL_PREFIX + "."
    return target[len(prefix):] if target.startswith(prefix) else target


def _owner(gm: fx.GraphModule, target: str):
    owner, _, leaf = target.rpartition(".")
    return (gm.get_submodule(owner) if owner else gm), leaf


def _meta_targets(gm: fx.GraphModule):
    """(target, tensor, is parameter, aliases) of every meta tensor the graph reads."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        module, leaf = _owner(gm, node.target)
        tensor = getattr(module, leaf)
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            info = get_meta(node, PARAM)
            aliases = info.aliases if info is not None else (node.target,)
            yield node.target, tensor, leaf in module._parameters, tuple(_user_name(a) for a in aliases)


def rank_slots(gms: list[fx.GraphModule], *, plan, coords: dict[str, int]) -> list[Slot]:
    """Every meta tensor of this rank's stage graphs as a :class:`Slot` (one per distinct tensor)."""
    from autopar.ops.zero3_ops import zero3_shards
    z3 = zero3_shards(gms)  # flat ZeRO-3 blocks: over dp, or (experts split over ep) over edp = dp / ep
    dims, ep = plan.dims, plan.expert_parallel  # expert tensors: this rank holds its ep block of dim 0
    experts = set(plan.expert_params) if ep > 1 else set()
    seen: set[int] = set()
    slots = []
    for gm in gms:
        for target, tensor, is_param, aliases in _meta_targets(gm):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = _user_name(target)
            spec = plan.param_shards.get(name) if is_param else None
            shard = z3.get(target)
            split_ep = is_param and name in experts
            layout = Layout.held(shard.shape if shard is not None else tuple(tensor.shape), tp=spec,
                                 tp_size=plan.mesh.tp, z3=shard.size if shard is not None else None,
                                 ep=ep if split_ep else None)
            slots.append(Slot(name=name, aliases=tuple(dict.fromkeys((name,) + aliases)), layout=layout,
                              tp_index=layout.tp_index(coords["tp"]), dtype=tensor.dtype,
                              z_index=shard.index(dims, coords) if shard is not None else coords["dp"],
                              kind="param" if is_param else "buffer", requires_grad=tensor.requires_grad,
                              ep_index=dims.index("ep", coords) if split_ep else 0))
    return slots


def _check_piece(slot: Slot, value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise PlanError(f"the filler gave no tensor for {slot.name}", where=where,
                        fix="return one local tensor per slot name from the filler")
    want = slot.layout.piece_shape()
    if tuple(value.shape) != tuple(want):
        raise PlanError(f"the filler gave {slot.name} of shape {tuple(value.shape)}, the rank holds {want}",
                        where=where, fix="cut the piece with autopar.runtime.checkpoints.checkpoint_layout.split("
                                         "full, slot.layout, "
                                         "tp_index=slot.tp_index, z_index=slot.z_index, ep_index=slot.ep_index)")
    return value


def materialize_rank(gms: list[fx.GraphModule], *, plan, coords: dict[str, int], fill: Filler,
                     device: torch.device | str = "cpu", masters: dict | None = None) -> list[Slot]:
    """Replace every meta tensor of ``gms`` by the real piece ``fill`` gives for it, on ``device``.

    ``masters``: filled with each parameter's piece in fp32 before it is cast to the graph's dtype
    (bf16 graphs: the fp32 masters the runtime steps, :class:`~autopar.runtime.state.mixed_precision.MasterWeights`)."""
    slots = rank_slots(gms, plan=plan, coords=coords)
    if not slots:
        return slots
    where = f"materialising rank (dp={coords['dp']}, pp={coords['pp']}, tp={coords['tp']})"
    pieces = fill(slots)
    real: dict[str, torch.Tensor] = {}
    for slot in slots:
        piece = _check_piece(slot, pieces.get(slot.name), where)
        if masters is not None and slot.kind == "param" and piece.is_floating_point():
            masters[slot.name] = piece.to(device=device, dtype=torch.float32)
        value = piece.to(device=device, dtype=slot.dtype)
        real[slot.name] = nn.Parameter(value, requires_grad=slot.requires_grad) if slot.kind == "param" else value
    by_id: dict[int, torch.Tensor] = {}
    for gm in gms:
        for target, tensor, is_param, _ in list(_meta_targets(gm)):
            if id(tensor) not in by_id:
                by_id[id(tensor)] = real[_user_name(target)] if _user_name(target) in real else None
            value = by_id[id(tensor)]
            if value is None:  # a tie seen under another name first: same tensor object
                continue
            module, leaf = _owner(gm, target)
            if is_param:
                module._parameters[leaf] = value
            elif leaf in module._buffers:
                module._buffers[leaf] = value
            else:
                setattr(module, leaf, value)
    log.info("%s: %d tensors, %.1f MB", where, len(slots), held_bytes(real.values()) / 1e6)
    return slots


def held_bytes(tensors) -> int:
    """Bytes of real storage behind ``tensors`` (meta tensors count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta)
