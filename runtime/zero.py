"""Optimizer-state sharding across the dp axis (ZeRO stage 1) for any torch.optim optimizer.

Parameters are partitioned whole (greedy by size, in name order) among the dp ranks, so the
update is exactly the one the unsharded optimizer computes, whatever the optimizer. Each rank
builds the user's optimizer over the parameters it owns, steps them, then every owner
broadcasts its updated parameters (one flat buffer per owner) to the dp group.
With ``zero_stage=0`` (or dp=1) it is the plain optimizer over all parameters.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
import torch.distributed as dist

__all__ = ["ShardedOptimizer", "partition_params"]

log = logging.getLogger(__name__)


def partition_params(named: list[tuple[str, torch.nn.Parameter]], num_parts: int) -> list[list[str]]:
    """Names per part, balancing element counts greedily (largest first, ties by name)."""
    parts: list[list[str]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for name, p in sorted(named, key=lambda kv: (-kv[1].numel(), kv[0])):
        k = min(range(num_parts), key=lambda i: (loads[i], i))
        parts[k].append(name)
        loads[k] += p.numel()
    return parts


class ShardedOptimizer:
    """The user's optimizer, with its state sharded over dp when ``zero_stage >= 1``."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 factory: Callable[[list], torch.optim.Optimizer], *, zero_stage: int,
                 dp_group, dp_ranks: list[int], dp_rank: int):
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.zero_stage = zero_stage
        self.dp_group, self.dp_ranks, self.dp_rank = dp_group, dp_ranks, dp_rank
        sharded = zero_stage >= 1 and len(dp_ranks) > 1
        self.owners = partition_params(self.named, len(dp_ranks)) if sharded else [[n for n, _ in self.named]]
        by_name = dict(self.named)
        mine = self.owners[dp_rank] if sharded else self.owners[0]
        self.local_names = mine
        self.sharded = sharded
        self.optimizer = factory([by_name[n] for n in mine]) if mine else None
        self._by_name = by_name

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        if self.sharded:
            self._broadcast_updates()

    def _broadcast_updates(self) -> None:
        for owner_index, names in enumerate(self.owners):
            if not names:
                continue
            tensors = [self._by_name[n].data for n in names]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=self.dp_ranks[owner_index], group=self.dp_group)
            if owner_index != self.dp_rank:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset: offset + t.numel()].view_as(t))
                    offset += t.numel()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict() if self.optimizer is not None else {}

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the ZeRO saving, measurable)."""
        if self.optimizer is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))
