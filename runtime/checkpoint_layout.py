"""How a rank's tensors map onto the single-device model: layouts, pieces, split and join.

A checkpoint stores every tensor as the *pieces* the ranks hold, each under its own key, with a
:class:`Layout` that says how the pieces join into the logical (single-device) tensor:

- ``tp=(dim, chunks, size)``: sharded over ``size`` tensor-parallel ranks on ``dim``; a fused
  projection (q, k, v in one weight) is ``chunks`` blocks, each sharded on its own, exactly as
  :func:`autopar.passes.tensor_parallel.shard_tensor` cuts it.
- ``z3=size``: the tp-local tensor flattened, zero-padded to a multiple of ``size`` and cut into
  ``size`` flat blocks, one per dp rank (ZeRO-3, :mod:`autopar.runtime.zero3_ops`).

Pieces are the only thing written, so saving moves no data between ranks; loading reads the
pieces of the saved layout, joins them and cuts the piece the loading rank's layout asks for.
Neither a chunked fused projection nor a flat ZeRO-3 block is a rectangle of the logical tensor,
so the pieces are plain tensors with this metadata rather than DTensors.

Example::

    >>> import torch
    >>> full = torch.arange(12.).view(6, 2)
    >>> layout = Layout(shape=(6, 2), tp=(0, 3, 2), z3=2)
    >>> pieces = {k: split(full, layout, tp_index=t, z_index=z) for k, t, z in layout.pieces("w")}
    >>> sorted(pieces)
    ['w#tp0#z0', 'w#tp0#z1', 'w#tp1#z0', 'w#tp1#z1']
    >>> torch.equal(join(pieces, layout, "w"), full)
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.passes.tensor_parallel import ShardSpec, shard_tensor
from autopar.runtime.state import unshard

__all__ = ["Layout", "split", "join", "piece_key"]


@dataclass(frozen=True)
class Layout:
    """Where one logical tensor's pieces come from (see the module docstring)."""

    shape: tuple[int, ...]
    tp: tuple[int, int, int] | None = None  # (dim, chunks, size)
    z3: int | None = None  # dp size of a flat ZeRO-3 sharding

    @property
    def tp_size(self) -> int:
        return self.tp[2] if self.tp else 1

    @property
    def z3_size(self) -> int:
        return self.z3 or 1

    def tp_local_shape(self) -> tuple[int, ...]:
        """The shape of one tensor-parallel shard (before any ZeRO-3 flattening)."""
        if not self.tp:
            return tuple(self.shape)
        dim, _, size = self.tp
        shape = list(self.shape)
        shape[dim] //= size
        return tuple(shape)

    def piece_shape(self) -> tuple[int, ...]:
        local = self.tp_local_shape()
        if not self.z3:
            return local
        return (math.ceil(math.prod(local) / self.z3),)

    def pieces(self, base: str):
        """(key, tp index, z3 index) of every piece."""
        return [(piece_key(base, t if self.tp else None, z if self.z3 else None), t, z)
                for t in range(self.tp_size) for z in range(self.z3_size)]

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "tp": list(self.tp) if self.tp else None, "z3": self.z3}

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        return cls(shape=tuple(data["shape"]), tp=tuple(data["tp"]) if data.get("tp") else None,
                   z3=data.get("z3"))


def piece_key(base: str, tp_index: int | None, z_index: int | None) -> str:
    """The checkpoint key of one piece: ``base``, then ``#tp<i>`` and ``#z<j>`` when sharded so."""
    return base + (f"#tp{tp_index}" if tp_index is not None else "") + (f"#z{z_index}" if z_index is not None else "")


def split(full: torch.Tensor, layout: Layout, *, tp_index: int, z_index: int) -> torch.Tensor:
    """The piece of ``full`` (the logical tensor) that rank (tp_index, z_index) holds under ``layout``."""
    local = full
    if layout.tp:
        dim, chunks, size = layout.tp
        local = shard_tensor(full, ShardSpec(dim=dim, chunks=chunks), rank=tp_index, size=size)
    if layout.z3:
        block = layout.piece_shape()[0]
        flat = torch.zeros(block * layout.z3, dtype=local.dtype, device=local.device)
        flat[:local.numel()] = local.reshape(-1)
        local = flat[z_index * block:(z_index + 1) * block]
    return local.clone()


def join(pieces: dict[str, torch.Tensor], layout: Layout, base: str) -> torch.Tensor:
    """The logical tensor from every piece of ``base`` (keys as :meth:`Layout.pieces` names them)."""
    tp_local = []
    for t in range(layout.tp_size):
        blocks = [pieces[piece_key(base, t if layout.tp else None, z if layout.z3 else None)]
                  for z in range(layout.z3_size)]
        if layout.z3:
            shape = layout.tp_local_shape()
            tp_local.append(torch.cat(blocks)[:math.prod(shape)].view(shape))
        else:
            tp_local.append(blocks[0])
    if not layout.tp:
        return tp_local[0]
    dim, chunks, _ = layout.tp
    return unshard(tp_local, dim=dim, chunks=chunks)
