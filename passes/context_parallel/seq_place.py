"""Where a value holds the sequence: one dim, possibly merged with others (a flattened batch x sequence).

A :class:`Place` says that dim ``dim`` of a value has ``outer * size * inner`` entries laid out as
(outer, sequence, inner): ``size`` positions of the sequence (the whole sequence, or the whole less a
shift), ``outer``/``inner`` the dims merged around it by a view (``logits.view(-1, vocab)`` merges the
batch before it). ``kind`` is ``shard`` for values that follow the sharded inputs and ``pos`` for values
computed from positions alone (an ``arange``, rotary tables, a position embedding's rows).

:func:`view_place` follows a place through any view or reshape by mixed-radix arithmetic on the flat
index: the sequence digit must fall inside one output dim; a view that cuts it across two dims (a
sequence split into windows) has no place.

Example::

    >>> p = Place(dim=1, size=24)
    >>> view_place(p, (2, 24, 128), (48, 128))
    Place(dim=0, size=24, outer=2, inner=1, kind='shard')
    >>> view_place(view_place(p, (2, 24, 128), (48, 128)), (48, 128), (2, 24, 128))
    Place(dim=1, size=24, outer=1, inner=1, kind='shard')
    >>> view_place(p, (2, 24, 128), (2, 4, 6, 128)) is None
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Place", "view_place", "moved", "aligned"]


@dataclass(frozen=True)
class Place:
    """The sequence in a value: dim ``dim`` is (outer, ``size`` positions, inner); see the module doc."""

    dim: int
    size: int
    outer: int = 1
    inner: int = 1
    kind: str = "shard"

    def extent(self) -> int:
        """The dim's whole size: outer x size x inner."""
        return self.outer * self.size * self.inner


def view_place(place: Place, in_shape, out_shape) -> Place | None:
    """``place`` after a view from ``in_shape`` to ``out_shape`` (same numel), or None when it is cut apart."""
    before = math.prod(in_shape[:place.dim]) * place.outer  # prefix product of the sequence digit
    after = before * place.size
    prefix = 1
    for o, radix in enumerate(out_shape):
        nxt = prefix * radix
        if radix > 1 and before % prefix == 0 and nxt % after == 0:
            return replace(place, dim=o, outer=before // prefix, inner=nxt // after)
        prefix = nxt
    return None


def moved(place: Place, dim: int) -> Place:
    """``place`` on another dim (transpose, permute, a dim dropped or added before it)."""
    return replace(place, dim=dim)


def aligned(place: Place, in_rank: int, out_rank: int) -> Place:
    """``place`` under right-aligned broadcasting from a value of ``in_rank`` dims into ``out_rank``."""
    return replace(place, dim=place.dim + out_rank - in_rank)
