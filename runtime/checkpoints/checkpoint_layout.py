"""How a rank's tensors map onto the single-device model: layouts, pieces, split and join.

A checkpoint stores every tensor as the *pieces* the ranks hold, each under its own key, with a
:class:`Layout` that says how the pieces join into the logical (single-device) tensor:

- ``tp``: a :class:`~autopar.ir.shard_layout.ShardLayout` over ``tp_size`` tensor-parallel ranks (equal
  chunks of a fused projection, kv heads cut in fewer parts, unequal blocks of a fused ``[q | k | v]``),
  exactly as the tensor-parallel pass cut it; its distinct pieces (``tp_ways``) are stored once each;
- ``z3=size``: the tp-local tensor flattened, zero-padded to a multiple of ``size`` and cut into
  ``size`` flat blocks, one per dp rank (ZeRO-3, :data:`~autopar.ir.shard_layout.ZERO3`;
  :mod:`autopar.ops.zero3_ops`);
- ``ep=size``: a mixture-of-experts expert tensor split over ``size`` expert-parallel ranks on dim 0
  (the experts, :data:`~autopar.ir.shard_layout.EXPERTS`; :mod:`autopar.passes.moe.moe_expert_parallel`),
  each ep rank's block then cut over tp.

Pieces are the only thing written, so saving moves no data between ranks; loading reads the
pieces of the saved layout, joins them and cuts the piece the loading rank's layout asks for.
Neither a chunked fused projection nor a flat ZeRO-3 block is a rectangle of the logical tensor,
so the pieces are plain tensors with this metadata rather than DTensors.

Example::

    >>> import torch
    >>> from autopar.ir.shard_layout import ShardLayout
    >>> full = torch.arange(12.).view(6, 2)
    >>> layout = Layout(shape=(6, 2), tp=ShardLayout(0, chunks=3), tp_size=2, z3=2)
    >>> pieces = {k: split(full, layout, tp_index=t, z_index=z) for k, t, z in layout.pieces("w")}
    >>> sorted(pieces)
    ['w#tp0#z0', 'w#tp0#z1', 'w#tp1#z0', 'w#tp1#z1']
    >>> torch.equal(join(pieces, layout, "w"), full)
    True
    >>> experts = Layout(shape=(4, 6), tp=ShardLayout(1), tp_size=2, ep=2)  # 4 experts over ep=2, each cut on dim 1
    >>> [k for k, _, _, _ in experts.expert_pieces("e")]
    ['e#ep0#tp0', 'e#ep0#tp1', 'e#ep1#tp0', 'e#ep1#tp1']
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.ir.shard_layout import EXPERTS, ZERO3, ShardLayout

__all__ = ["Layout", "split", "join", "piece_key"]


@dataclass(frozen=True)
class Layout:
    """Where one logical tensor's pieces come from (see the module docstring)."""

    shape: tuple[int, ...]
    tp: ShardLayout | None = None  # how the tensor is cut over tp (None: whole on every tp rank)
    tp_size: int = 1  # the tp degree ``tp`` cuts over
    z3: int | None = None  # dp size of a flat ZeRO-3 sharding
    ep: int | None = None  # expert-parallel size of an expert tensor split on dim 0

    @classmethod
    def held(cls, local_shape, *, tp: ShardLayout | None, tp_size: int, z3: int | None = None,
             ep: int | None = None) -> "Layout":
        """The layout of a tensor a rank holds as ``local_shape`` (its tp-local shape; ZeRO-3's flat block is
        described by ``z3``), cut over tp as ``tp`` says and, an expert tensor, over ep on dim 0."""
        shape = tp.full_shape(local_shape, tp_size) if tp is not None else tuple(local_shape)
        shape = EXPERTS.full_shape(shape, ep) if ep else shape
        return cls(shape=tuple(shape), tp=tp, tp_size=tp_size if tp is not None else 1, z3=z3, ep=ep)

    @property
    def tp_ways(self) -> int:
        """How many distinct tensor-parallel pieces there are (a kv head held by several tp ranks: once)."""
        return self.tp.ways(self.tp_size) if self.tp else 1

    def tp_index(self, tp_rank: int) -> int:
        """The tp piece that tensor-parallel rank ``tp_rank`` holds."""
        return self.tp.piece_of(tp_rank, self.tp_size) if self.tp else 0

    def tp_rank(self, tp_index: int) -> int:
        """The first tensor-parallel rank holding tp piece ``tp_index``."""
        return self.tp.first_rank(tp_index, self.tp_size) if self.tp else 0

    @property
    def z3_size(self) -> int:
        return self.z3 or 1

    @property
    def ep_size(self) -> int:
        return self.ep or 1

    def ep_local_shape(self) -> tuple[int, ...]:
        """The shape of one expert-parallel block (this ep rank's experts, before the tp cut)."""
        return EXPERTS.local_shape(self.shape, self.ep) if self.ep else self.shape

    def tp_local_shape(self) -> tuple[int, ...]:
        """The shape of one tensor-parallel shard (of an ep block; before any ZeRO-3 flattening)."""
        local = self.ep_local_shape()
        return self.tp.local_shape(local, self.tp_size) if self.tp else local

    def piece_shape(self) -> tuple[int, ...]:
        local = self.tp_local_shape()
        if not self.z3:
            return local
        return (ZERO3.local_size(math.prod(local), self.z3),)

    def pieces(self, base: str):
        """(key, tp index, z3 index) of every piece (of every ep block: :meth:`expert_pieces` names the block)."""
        return [(key, t, z) for key, _, t, z in self.expert_pieces(base)]

    def expert_pieces(self, base: str):
        """(key, ep index, tp index, z3 index) of every piece."""
        return [(self.key(base, ep_index=e, tp_index=t, z_index=z), e, t, z)
                for e in range(self.ep_size) for t in range(self.tp_ways) for z in range(self.z3_size)]

    def key(self, base: str, *, ep_index: int, tp_index: int, z_index: int) -> str:
        """The key of the piece that rank (ep_index, tp_index, z_index) holds (only the cut axes named)."""
        return piece_key(base, tp_index if self.tp else None, z_index if self.z3 else None,
                         ep_index if self.ep else None)

    def to_json(self) -> dict:
        out = {"shape": list(self.shape), "tp": self.tp.fields() if self.tp else None, "z3": self.z3}
        out = {**out, "tp_size": self.tp_size} if self.tp else out
        return {**out, "ep": self.ep} if self.ep else out

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        tp, tp_size = data.get("tp"), data.get("tp_size", 1)
        if isinstance(tp, list):  # written before ShardLayout: [dim, chunks, pieces], piece i on rank i
            tp, tp_size = {"dim": tp[0], "chunks": tp[1]}, tp[2]
        tp = ShardLayout(**{k: tuple(map(tuple, v)) if k == "blocks" else v for k, v in tp.items()}) if tp else None
        return cls(shape=tuple(data["shape"]), tp=tp, tp_size=tp_size if tp else 1, z3=data.get("z3"),
                   ep=data.get("ep"))


def piece_key(base: str, tp_index: int | None, z_index: int | None, ep_index: int | None = None) -> str:
    """The checkpoint key of one piece: ``base``, then ``#ep<e>``, ``#tp<i>`` and ``#z<j>`` when sharded so."""
    return (base + (f"#ep{ep_index}" if ep_index is not None else "")
            + (f"#tp{tp_index}" if tp_index is not None else "") + (f"#z{z_index}" if z_index is not None else ""))


def split(full: torch.Tensor, layout: Layout, *, tp_index: int, z_index: int, ep_index: int = 0) -> torch.Tensor:
    """The piece of ``full`` (the logical tensor) that rank (ep_index, tp_index, z_index) holds under ``layout``."""
    local = full
    if layout.ep:
        local = EXPERTS.cut(local, rank=ep_index, size=layout.ep)
    if layout.tp:
        local = layout.tp.cut(local, rank=layout.tp_rank(tp_index), size=layout.tp_size)
    if layout.z3:
        local = ZERO3.cut(local.reshape(-1), rank=z_index, size=layout.z3)
    return local.clone()


def join(pieces: dict[str, torch.Tensor], layout: Layout, base: str) -> torch.Tensor:
    """The logical tensor from every piece of ``base`` (keys as :meth:`Layout.expert_pieces` names them)."""
    blocks = [_join_block(pieces, layout, base, e) for e in range(layout.ep_size)]
    return EXPERTS.join(blocks, size=layout.ep) if layout.ep else blocks[0]


def _join_block(pieces: dict[str, torch.Tensor], layout: Layout, base: str, ep_index: int) -> torch.Tensor:
    """One ep block (the whole tensor without ep) from its tp and ZeRO-3 pieces."""
    tp_local = []
    for t in range(layout.tp_ways):
        blocks = [pieces[layout.key(base, ep_index=ep_index, tp_index=t, z_index=z)] for z in range(layout.z3_size)]
        if layout.z3:
            shape = layout.tp_local_shape()
            tp_local.append(ZERO3.join(blocks, size=layout.z3, extent=math.prod(shape)).view(shape))
        else:
            tp_local.append(blocks[0])
    return layout.tp.join(tp_local, size=layout.tp_size) if layout.tp else tp_local[0]
