"""How a sequence is cut over the cp ranks, and the helpers that cut a batch and join it back.

Context parallelism gives each cp rank a part of every sequence. With ``load_balanced=True`` (the
default, as torchtitan, Megatron-Core and torch's ``context_parallel`` do for causal attention) the
sequence is cut into ``2 * cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2*cp - 1 - i``:
under a causal mask an early chunk has few keys to attend to and a late one many, so the pair gives
every rank the same work. Without it rank ``i`` holds chunk ``i`` of ``cp``.

A rank's part, in the order it holds it, is its *shard*; the global position of each of its tokens
is :meth:`CpLayout.positions`. The shards of ranks ``0..cp-1`` put one after another are the
*layout order* (what an all-gather or all-to-all over cp yields); :meth:`CpLayout.order` maps it to
global positions.

Packed sequences (several documents in one row, ``position_ids`` restarting at 0 for each, as
transformers' flattening collator makes them) carry their document ids: :func:`document_ids`
numbers the documents of each row from the *whole* row's positions (so a document that crosses a
shard boundary keeps one id on both ranks), before the row is cut.

Example::

    >>> layout = CpLayout(seq_len=8, cp=2)
    >>> layout.positions(0).tolist(), layout.positions(1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> x = torch.arange(8).view(1, 8)
    >>> layout.join([layout.shard(x, dim=1, rank=r) for r in range(2)], dim=1).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    >>> document_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])).tolist()
    [[0, 0, 0, 1, 1, 2, 2, 2]]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from autopar.errors import PlanError

__all__ = ["CpLayout", "document_ids", "shard_batch", "join_batch"]


@dataclass(frozen=True)
class CpLayout:
    """The cut of a sequence of ``seq_len`` tokens over ``cp`` ranks (load-balanced or contiguous)."""

    seq_len: int
    cp: int
    load_balanced: bool = True

    def __post_init__(self):
        if self.cp < 1:
            raise PlanError(f"context parallelism needs cp >= 1, got cp={self.cp}", where="the cp layout",
                            fix="pass a positive cp")
        if self.seq_len % self.num_chunks:
            how = "2 x cp (load-balanced: two chunks per rank)" if self.load_balanced else "cp"
            raise PlanError(f"a sequence of {self.seq_len} tokens does not divide by {how} = {self.num_chunks}",
                            where=f"the cp layout (cp={self.cp}, load_balanced={self.load_balanced})",
                            fix=f"pad every sequence to a multiple of {self.num_chunks} tokens (padding labels -100, "
                                f"attention_mask 0), or choose a cp that divides it")

    @property
    def num_chunks(self) -> int:
        """How many equal chunks the sequence is cut into: ``2 * cp`` load-balanced, else ``cp``."""
        return 2 * self.cp if self.load_balanced else self.cp

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        """Tokens each rank holds of a sequence."""
        return self.seq_len // self.cp

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank ``rank`` holds, in the order it holds them."""
        self._check_rank(rank)
        return (rank, self.num_chunks - 1 - rank) if self.load_balanced else (rank,)

    def runs(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(global start, length)`` of each contiguous run of rank ``rank``'s shard, in its order."""
        return tuple((c * self.chunk, self.chunk) for c in self.chunks_of(rank))

    def positions(self, rank: int, *, device=None) -> torch.Tensor:
        """The global position of each token of rank ``rank``'s shard (int64, ``local_len``)."""
        return torch.cat([torch.arange(start, start + length, device=device) for start, length in self.runs(rank)])

    def order(self, *, device=None) -> torch.Tensor:
        """The global position of each token in layout order (every rank's shard, rank by rank)."""
        return torch.cat([self.positions(r, device=device) for r in range(self.cp)])

    def shard(self, x: torch.Tensor, *, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``x`` along its sequence dim ``dim`` (a new tensor)."""
        if x.shape[dim] != self.seq_len:
            raise PlanError(f"a tensor of shape {tuple(x.shape)} has {x.shape[dim]} positions on dim {dim}, "
                            f"the cp layout cuts {self.seq_len}", where="CpLayout.shard",
                            fix="cut tensors whose sequence dim holds the layout's sequence length")
        return torch.cat([x.narrow(dim, start, length) for start, length in self.runs(rank)], dim=dim)

    def join(self, pieces, *, dim: int) -> torch.Tensor:
        """The whole sequence from every rank's shard (``pieces[r]`` is rank ``r``'s), in global order."""
        if len(pieces) != self.cp:
            raise PlanError(f"{len(pieces)} shards given, the layout has {self.cp} ranks", where="CpLayout.join",
                            fix="pass one shard per cp rank, in rank order")
        stacked = torch.cat(list(pieces), dim=dim)
        return stacked.index_select(dim, torch.argsort(self.order(device=stacked.device)))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp:
            raise PlanError(f"cp rank {rank} is outside 0..{self.cp - 1}", where="the cp layout",
                            fix="pass the rank's index along the cp mesh axis")


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document ids of packed rows: a new document starts where ``position_ids`` does not rise by 1.

    ``position_ids`` (..., seq) of whole rows (before any cut); the ids count from 0 in each row.
    """
    step = position_ids[..., 1:] - position_ids[..., :-1]
    starts = torch.cat([torch.zeros_like(position_ids[..., :1]), (step != 1).long()], dim=-1)
    return starts.cumsum(-1)


def shard_batch(batch: Mapping[str, torch.Tensor], *, layout: CpLayout, rank: int, seq_dim: int = 1,
                keys=None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of a dict batch: every tensor with ``seq_len`` positions on ``seq_dim`` cut.

    ``keys``: which entries carry the sequence (default: every tensor whose ``seq_dim`` has the
    layout's length). Adds ``position_ids`` (the global positions of the shard, per row) when the
    batch has none, and ``document_ids`` (:func:`document_ids` of the whole rows) when it has
    ``position_ids`` that restart (packed documents).
    """
    batch = dict(batch)
    keys = tuple(keys) if keys is not None else tuple(
        k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > seq_dim
        and v.shape[seq_dim] == layout.seq_len)
    if "position_ids" in batch:
        docs = document_ids(batch["position_ids"])
        if bool((docs[..., -1] > 0).any()):
            batch["document_ids"] = docs
            keys = keys + ("document_ids",)
    else:
        first = next(iter(batch[k] for k in keys), None)
        lead = first.shape[:seq_dim] if first is not None else ()
        device = first.device if first is not None else None
        batch["position_ids"] = torch.arange(layout.seq_len, device=device).expand(*lead, layout.seq_len)
        keys = keys + ("position_ids",)
    return {k: (layout.shard(v, dim=seq_dim, rank=rank) if k in keys else v) for k, v in batch.items()}


def join_batch(pieces, *, layout: CpLayout, seq_dim: int = 1, keys) -> dict[str, torch.Tensor]:
    """The whole batch from every rank's :func:`shard_batch` (``pieces[r]`` is rank ``r``'s dict), for ``keys``."""
    return {k: layout.join([p[k] for p in pieces], dim=seq_dim) for k in keys}
