"""What this rank holds of the single-device model: each parameter and persistent buffer, its
single-device name (the smallest of a tied weight's names), and how it is cut (a :class:`Layout`).

Read by checkpoints (:mod:`autopar.runtime.checkpoints.checkpoint`) and by ``full_state_dict`` (buffers).
The parameters are ``program.parameter_values()``: collective over dp under mixed precision with
ZeRO-1/2, where a parameter's fp32 master lives on its owner only. A value fetched that way is a
copy, so what a load writes into it is set on this rank by the program's ``publish_parameters``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.ir.graph_names import user_name
from autopar.runtime.checkpoints.checkpoint_layout import Layout, piece_key
from autopar.runtime.execution.rank_context import ProgramState

__all__ = ["Held", "held_tensors", "model_buffers"]


@dataclass(frozen=True)
class Held:
    """One tensor this rank holds: its single-device name, the tensor, and how it is cut."""

    name: str  # canonical single-device name (the smallest of a tied weight's names)
    aliases: tuple[str, ...]
    tensor: torch.Tensor
    layout: Layout
    tp_index: int
    z_index: int
    kind: str  # "param" | "buffer"
    ep_index: int = 0  # this rank's block of an expert tensor split over ep (layout.ep)

    def piece(self, base: str) -> str:
        """The key of this rank's piece of ``base`` (only the axes its layout cuts named)."""
        return self.layout.key(base, ep_index=self.ep_index, tp_index=self.tp_index, z_index=self.z_index)

    def own_piece(self, base: str) -> str:
        """The key of a piece whose shape is this rank's own (opaque optimizer state): every axis named."""
        return piece_key(base, self.tp_index, self.z_index, self.ep_index if self.layout.ep else None)


# -- what this rank holds -----------------------------------------------------------------------
def _zero3_shards(program: ProgramState) -> dict:
    """{single-device name: :class:`~autopar.ops.zero3_ops.Zero3Shard`} of the parameters held as flat
    ZeRO-3 shards (by name, so their fp32 masters under bf16, flat blocks too, are found as well)."""
    from autopar.ops.zero3_ops import zero3_shards
    return {user_name(t): z for t, z in zero3_shards([s.gm for s in program.stages.values()]).items()}


def model_buffers(program: ProgramState) -> list[tuple[str, torch.Tensor]]:
    """(single-device name, tensor) of the persistent buffers this rank's stages read (BatchNorm stats)."""
    seen, out = set(), []
    for stage in program.stages.values():
        for node in stage.gm.graph.nodes:
            if node.op != "get_attr" or node.target in seen:
                continue
            seen.add(node.target)
            owner, _, leaf = node.target.rpartition(".")
            module = stage.gm.get_submodule(owner) if owner else stage.gm
            name = user_name(node.target)
            if leaf in module._buffers and name in program.state_keys:
                out.append((name, module._buffers[leaf]))
    return out


def held_tensors(program: ProgramState) -> list[Held]:
    """Every parameter and persistent buffer this rank holds, with its layout (the model's tensors no
    stage graph reads among the buffers)."""
    plan, coords = program.plan, program.info.coords
    z3 = _zero3_shards(program)  # flat blocks over dp, or over edp (dp / ep) for expert tensors
    dims, ep = plan.dims, plan.expert_parallel  # expert tensors: this rank holds its ep block of dim 0
    experts = set(plan.expert_params) if ep > 1 else set()
    held = []
    for name, p in program.parameter_values():  # fp32 masters under bf16, fetched from ZeRO-1/2 owners
        layout = Layout.held(z3[name].shape if name in z3 else tuple(p.shape), tp=plan.param_shards.get(name),
                             tp_size=plan.mesh.tp, z3=z3[name].size if name in z3 else None,
                             ep=ep if name in experts else None)
        aliases = tuple(sorted(program.aliases.get(name, (name,))))
        z_index = z3[name].index(dims, coords) if name in z3 else coords["dp"]
        held.append(Held(aliases[0], aliases, p, layout, layout.tp_index(coords["tp"]), z_index, "param",
                         ep_index=dims.index("ep", coords) if name in experts else 0))
    for name, b in model_buffers(program):
        held.append(Held(name, (name,), b, Layout(shape=tuple(b.shape)), 0, 0, "buffer"))
    for u in program.unused:  # read by no stage graph, kept whole on every rank (unused_state.py)
        held.append(Held(u.name, u.aliases, u.tensor, Layout(shape=tuple(u.tensor.shape)), 0, 0, "buffer"))
    return held
