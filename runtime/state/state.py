"""Gather a parallel program's weights into one single-device state_dict."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_full_state_dict"]


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
        tensor = per_rank[0] if shard is None else shard.join([per_rank[r] for r in sorted(per_rank)],
                                                              size=len(per_rank))
        for alias in aliases.get(name, (name,)):
            full[alias] = tensor
    return {k: full[k] for k in keys if k in full}
