"""How a tensor is cut over a group of ranks and joined back: :class:`ShardLayout`, the one place that knows.

A layout cuts dim ``dim`` of a tensor over ``size`` ranks (the tensor-parallel degree; or the expert-parallel
one, for an expert tensor's dim 0). The dim holds one or more blocks, each cut on its own:

- ``chunks`` equal blocks (``chunks`` 1: the whole dim): a fused ``[q | k | v]`` projection is 3 chunks, rank
  r holding block piece r of each;
- ``parts`` > 0: each block is cut in only that many pieces (a divisor of ``size``), rank r holding piece
  ``r * parts // size``: fewer kv heads than ranks, each piece replicated over ``size / parts`` ranks;
- ``blocks``: unequal blocks ``(extent, parts)``, each cut on its own (``parts`` 0: ``size`` ways): a fused
  ``[q | k | v]`` with fewer kv heads than query heads (Phi-3's ``qkv_proj`` with grouped-query attention);
- ``inner``: a second dim, cut in the other ``size / parts`` ways (minor; rank r holds piece
  ``r % (size / parts)``): a kv head broadcast to its query heads (a tensor-parallel placement's, never a
  parameter's);
- ``pad``: the dim is zero-padded to a multiple of ``size`` first, so any extent cuts (rank r holds block r,
  the last ones the padding): ZeRO-3's flat blocks of a flattened tensor (:data:`ZERO3`).

Rank r's piece is the concatenation of its piece of every block (:meth:`ShardLayout.ranges` says which index
ranges); ranks holding the same piece hold equal copies, so a layout has :meth:`ShardLayout.ways` distinct
pieces. :meth:`ShardLayout.cut` gives a rank's piece, :meth:`ShardLayout.join` the full tensor from the
pieces, :meth:`ShardLayout.local_size` a piece's extent on the cut dim. The tensor-parallel passes, the Plan
(``Plan.param_shards``), checkpoints, the Hugging Face loader and saver and the meta materialiser all read it.

Example::

    >>> import torch
    >>> qkv = ShardLayout(dim=0, blocks=((4, 0), (2, 1), (2, 1)))  # 4 q rows over 2 ranks; k and v whole
    >>> full = torch.arange(8)
    >>> [qkv.cut(full, rank=r, size=2).tolist() for r in range(2)]
    [[0, 1, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]
    >>> qkv.local_size(8, size=2), qkv.ways(2)
    (6, 2)
    >>> torch.equal(qkv.join([qkv.cut(full, rank=r, size=2) for r in range(2)], size=2), full)
    True
    >>> ShardLayout(dim=1, chunks=3)
    ShardLayout(dim=1, chunks=3)
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

__all__ = ["ShardLayout", "Block", "EXPERTS", "ZERO3"]


class Block(NamedTuple):
    """One block of a cut dim: its extent, the extent of one piece, and how many pieces it is cut in."""

    extent: int
    local: int
    ways: int


@dataclass(frozen=True)
class ShardLayout:
    """Dim ``dim`` cut over a group of ranks, in equal ``chunks`` or unequal ``blocks`` (module docstring)."""

    dim: int
    chunks: int = 1
    parts: int = 0
    inner: int | None = None
    blocks: tuple[tuple[int, int], ...] = ()
    pad: bool = False

    def __post_init__(self) -> None:
        if self.dim < 0 or self.chunks < 1 or self.parts < 0:
            raise ValueError(f"{self!r} needs dim >= 0, chunks >= 1 and parts >= 0; give those")
        object.__setattr__(self, "blocks", tuple((int(n), int(p)) for n, p in self.blocks))
        if self.blocks and (self.chunks != 1 or self.parts or self.inner is not None):
            raise ValueError(f"{self!r}: unequal blocks carry their own parts; give blocks alone "
                             "(chunks 1, parts 0, no inner)")
        if any(n < 1 or p < 0 for n, p in self.blocks):
            raise ValueError(f"{self!r}: every block needs an extent >= 1 and parts >= 0; give those")
        if self.inner is not None and (self.parts < 1 or self.inner == self.dim):
            raise ValueError(f"{self!r}: an inner dim is cut size / parts ways; give parts > 0 and "
                             "an inner dim other than dim")
        if self.pad and (self.chunks != 1 or self.parts or self.inner is not None or self.blocks):
            raise ValueError(f"{self!r}: a padded dim is cut in one block over every rank; give pad alone")

    def fields(self) -> dict:
        """The fields that differ from their default (``dim`` always): the layout as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name == "dim" or getattr(self, f.name) != f.default}

    def __repr__(self) -> str:
        return f"ShardLayout({', '.join(f'{k}={v!r}' for k, v in self.fields().items())})"

    def __str__(self) -> str:
        """The short form a placement prints: ``0``, ``1,chunks=3``, ``2,parts=1,inner=3``."""
        return "".join([str(self.dim), f",chunks={self.chunks}" if self.chunks != 1 else "",
                        f",parts={self.parts}" if self.parts else "",
                        f",inner={self.inner}" if self.inner is not None else "",
                        f",blocks={list(self.blocks)}" if self.blocks else "", ",pad" if self.pad else ""])

    # -- which piece a rank holds ----------------------------------------------------------------
    def blocks_of(self, extent: int, size: int) -> tuple[Block, ...]:
        """The blocks of a dim of ``extent`` cut over ``size`` ranks."""
        if self.pad:
            return (Block(extent, -(-extent // size), size),)
        cuts = self.blocks or ((extent // self.chunks, self.parts),) * self.chunks
        return tuple(Block(n, n // (p or size), p or size) for n, p in cuts)

    def _owners(self, size: int) -> list[int]:
        """The first rank holding each distinct piece, in order (ranks holding equal pieces are consecutive)."""
        cuts = [p or size for _, p in self.blocks] or [self.parts or size]
        owners, seen = [], set()
        for rank in range(size):
            key = tuple(rank * w // size for w in cuts) + ((rank,) if self.inner is not None else ())
            if key not in seen:
                seen.add(key)
                owners.append(rank)
        return owners

    def ways(self, size: int) -> int:
        """How many distinct pieces ``size`` ranks hold (a piece held by several ranks counts once)."""
        return len(self._owners(size))

    def piece_of(self, rank: int, size: int) -> int:
        """The piece (of :meth:`ways`) that ``rank`` of ``size`` holds."""
        return bisect.bisect_right(self._owners(size), rank) - 1

    def first_rank(self, piece: int, size: int) -> int:
        """The first of the ranks holding ``piece``."""
        return self._owners(size)[piece]

    # -- shapes ----------------------------------------------------------------------------------
    def local_size(self, extent: int, size: int) -> int:
        """The extent a rank holds of the cut dim, of ``extent`` in the full tensor."""
        return sum(b.local for b in self.blocks_of(extent, size))

    def local_shape(self, shape, size: int) -> tuple[int, ...]:
        """A rank's piece's shape, of a full tensor of ``shape`` (a ``-1`` a view infers stays ``-1``)."""
        out = list(shape)
        if out[self.dim] != -1:
            out[self.dim] = self.local_size(out[self.dim], size)
        if self.inner is not None and out[self.inner] != -1:
            out[self.inner] //= size // self.parts
        return tuple(out)

    def full_shape(self, shape, size: int) -> tuple[int, ...]:
        """The full tensor's shape, of a rank's piece of ``shape`` (a padded layout: with the padding)."""
        out = list(shape)
        out[self.dim] = sum(n for n, _ in self.blocks) if self.blocks else out[self.dim] * (self.parts or size)
        if self.inner is not None:
            out[self.inner] *= size // self.parts
        return tuple(out)

    def misfit(self, shape, size: int, *, what: str = "the tensor") -> str | None:
        """Why this layout does not cut ``what``, of ``shape``, evenly over ``size`` ranks, or None."""
        shape = tuple(shape)
        if self.blocks:
            bad = [n for n, p in self.blocks if n % (p or size)]
            return (f"a block of size {bad[0]} of dim {self.dim} of {what} {shape} is not divisible by tp={size}"
                    if bad else None)
        if shape[self.dim] % (self.chunks * (self.parts or size)) and not self.pad:
            return (f"dim {self.dim} of {what} {shape} has size {shape[self.dim]}, not divisible by tp={size}"
                    + (f" x {self.chunks} blocks" if self.chunks > 1 else "")
                    + (f" (cut {self.parts} ways)" if self.parts else ""))
        if self.inner is not None and shape[self.inner] % (size // self.parts):
            return (f"dim {self.inner} of {what} {shape} has size {shape[self.inner]}, "
                    f"not divisible by {size // self.parts}")
        return None

    def between(self, start: int, stop: int) -> ShardLayout:
        """The layout of ``[start, stop)`` of the dim holding unequal ``blocks``: the whole blocks inside it
        (a single one as a plain cut ``parts`` ways). ValueError when the range cuts across a block."""
        inside, offset = [], 0
        for n, p in self.blocks:
            if start <= offset and offset + n <= stop:
                inside.append((n, p))
            offset += n
        if not inside or sum(n for n, _ in inside) != stop - start:
            raise ValueError(f"[{start}, {stop}) cuts across the blocks {list(self.blocks)} of dim {self.dim}")
        if len(inside) == 1:
            return ShardLayout(self.dim, parts=inside[0][1])
        return ShardLayout(self.dim, blocks=tuple(inside))

    # -- cutting and joining ---------------------------------------------------------------------
    def ranges(self, shape, *, rank: int, size: int) -> list[list[tuple[int, int]]]:
        """Per dim of a full tensor of ``shape``, the index ranges whose concatenation is ``rank``'s piece."""
        out = [[(0, n)] for n in shape]
        runs, offset = [], 0
        for b in self.blocks_of(shape[self.dim], size):
            index = rank * b.ways // size
            start, stop = (offset + index * b.local, offset + (index + 1) * b.local)
            runs.append((min(start, b.extent), min(stop, b.extent)) if self.pad else (start, stop))
            offset += b.extent
        out[self.dim] = runs
        if self.inner is not None:
            ways = size // self.parts
            local = shape[self.inner] // ways
            out[self.inner] = [((rank % ways) * local, (rank % ways + 1) * local)]
        return out

    def cut(self, full: torch.Tensor, *, rank: int, size: int) -> torch.Tensor:
        """``rank``'s piece of ``full`` over ``size`` ranks: a new, contiguous tensor."""
        out = full
        for d, runs in enumerate(self.ranges(full.shape, rank=rank, size=size)):
            if runs != [(0, full.shape[d])]:
                out = torch.cat([out.narrow(d, a, b - a) for a, b in runs], dim=d)
        local = self.local_size(full.shape[self.dim], size)
        if self.pad and out.shape[self.dim] < local:  # (a last block: its padding, zeros)
            shape = list(out.shape)
            shape[self.dim] = local - shape[self.dim]
            out = torch.cat([out, out.new_zeros(shape)], dim=self.dim)
        return full.clone(memory_format=torch.contiguous_format) if out is full else out

    def pieces(self, full: torch.Tensor, *, size: int) -> list[torch.Tensor]:
        """Every distinct piece of ``full`` over ``size`` ranks, in order (:meth:`ways` of them); views of one
        padded copy (a padded layout) or of ``full`` (a plain cut in one block per rank), else new tensors."""
        local = self.local_size(full.shape[self.dim], size)
        if self.pad:  # one padded copy, viewed as its blocks
            shape = list(full.shape)
            shape[self.dim] = local * size
            padded = full.new_zeros(shape)
            padded.narrow(self.dim, 0, full.shape[self.dim]).copy_(full)
            return list(padded.unflatten(self.dim, (size, local)).unbind(self.dim))
        if self.fields() == {"dim": self.dim}:  # one block per rank: views of ``full``
            return list(full.unflatten(self.dim, (size, local)).unbind(self.dim))
        return [self.cut(full, rank=self.first_rank(j, size), size=size) for j in range(self.ways(size))]

    def join(self, pieces: list[torch.Tensor], *, size: int, extent: int | None = None) -> torch.Tensor:
        """The full tensor from its pieces over ``size`` ranks: one per piece (:meth:`ways` of them, in
        order), or one per rank (``size`` of them, of which the first holder of each piece is read).
        ``extent``: the cut dim's full extent, without the padding of a padded layout."""
        ways = self.ways(size)
        if len(pieces) == size and ways != size:
            pieces = [pieces[self.first_rank(j, size)] for j in range(ways)]
        if len(pieces) != ways:
            raise ValueError(f"{self!r} over {size} ranks joins {ways} pieces, got {len(pieces)}")
        shape = self.full_shape(pieces[0].shape, size)
        out = pieces[0].new_empty(shape)
        for j, piece in enumerate(pieces):
            per_dim = []
            for runs in self.ranges(shape, rank=self.first_rank(j, size), size=size):
                at, placed = 0, []
                for a, b in runs:
                    placed.append((slice(a, b), slice(at, at + b - a)))
                    at += b - a
                per_dim.append(placed)
            for combo in itertools.product(*per_dim):
                out[tuple(dst for dst, _ in combo)] = piece[tuple(src for _, src in combo)]
        return out if extent is None else out.narrow(self.dim, 0, extent)

    # -- the Plan's JSON ---------------------------------------------------------------------------
    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        """pydantic validates the fields (and ``__post_init__``); JSON leaves ``inner`` and ``pad`` out when
        unset (a tensor-parallel parameter's layout never has them)."""
        from pydantic_core import core_schema

        def serialize(value, nxt):
            out = nxt(value)
            if isinstance(out, dict):
                if out.get("inner") is None:
                    out.pop("inner", None)
                if not out.get("pad", True):
                    out.pop("pad")
            return out

        schema = handler(source)
        schema["serialization"] = core_schema.wrap_serializer_function_ser_schema(serialize)
        return schema


EXPERTS = ShardLayout(0)  # an expert tensor split over ep ranks: its experts (dim 0), rank j holding block j
ZERO3 = ShardLayout(0, pad=True)  # ZeRO-3's flat blocks: a tensor flattened, zero-padded, rank r holding block r
