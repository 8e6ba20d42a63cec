"""Gather a parallel program's weights into one single-device state_dict."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_full_state_dict", "unshard"]


def unshard(pieces: list[torch.Tensor], *, dim: int, chunks: int, parts: int = 0, blocks=()) -> torch.Tensor:
    """Inverse of :func:`autopar.passes.tensor_parallel.shard_tensor`: pieces in tp-rank order."""
    if blocks:  # unequal (size, parts) blocks: each rank's piece is its cut of every block in turn
        size = len(pieces)
        split = [p.split([b // (w or size) for b, w in blocks], dim=dim) for p in pieces]
        return torch.cat([unshard([s[i] for s in split], dim=dim, chunks=1, parts=w) for i, (_, w) in enumerate(blocks)],
                         dim=dim)
    if parts:  # each piece held by len(pieces) / parts ranks: keep one of each
        pieces = pieces[::len(pieces) // parts]
    blocks = [p.chunk(chunks, dim=dim) for p in pieces]
    return torch.cat([torch.cat([b[c] for b in blocks], dim=dim) for c in range(chunks)], dim=dim)


def gather_full_state_dict(named_params, *, plan, info, aliases: dict, keys: tuple[str, ...]) -> dict:
    """Every rank sends its shards (dp index 0 only); every rank rebuilds the full tensors."""
    mine = {}
    if info.coords["dp"] == 0:
        mine = {name: p.detach().cpu() for name, p in named_params}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (info.coords["tp"], mine))
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, tensors in gathered:
        for name, t in tensors.items():
            by_name.setdefault(name, {})[tp_rank] = t
    full = {}
    for name, per_rank in by_name.items():
        shard = plan.param_shards.get(name)
        tensor = per_rank[0] if shard is None else unshard([per_rank[r] for r in sorted(per_rank)],
                                                          dim=shard.dim, chunks=shard.chunks,
                                                          parts=shard.parts, blocks=shard.blocks)
        for alias in aliases.get(name, (name,)):
            full[alias] = tensor
    return {k: full[k] for k in keys if k in full}
