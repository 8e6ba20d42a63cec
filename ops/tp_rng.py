"""Random streams under tensor parallelism, arranged as Megatron arranges them.

- Random ops in *replicated* regions (a dropout after g, on the embedding sum) draw from torch's
  default generator, as on one device. Every tp rank is seeded alike, so every rank draws the
  same mask, and the values stay replicated.
- Random ops in *sharded* regions (attention-probability dropout on this rank's heads, any dropout
  on a sequence-parallel shard) run inside :meth:`TpRngTracker.fork`: the default generator's state
  is swapped for a per-rank stream seeded ``seed + 2718 + tp_rank``, so each rank draws its own
  mask for its own slice, and the default stream is left untouched.

:class:`ShardedRandom` is the graph node that does this for one op. Example::

    >>> tracker = TpRngTracker(seed=1234 + 2718 + 0)
    >>> node_module = ShardedRandom(torch.ops.aten.dropout.default, tracker=tracker)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

__all__ = ["TpRngTracker", "ShardedRandom", "TP_RNG_OFFSET", "tp_rng_seed"]

TP_RNG_OFFSET = 2718  # Megatron's offset of the model-parallel stream from the data seed


def tp_rng_seed(base_seed: int, tp_rank: int) -> int:
    """The seed of tp rank ``tp_rank``'s sharded-region stream."""
    return base_seed + TP_RNG_OFFSET + tp_rank


class TpRngTracker:
    """One rank's sharded-region random stream; shared by every :class:`ShardedRandom` of the rank."""

    def __init__(self, *, seed: int):
        self.seed = seed
        self.cpu_state = torch.Generator().manual_seed(seed).get_state()
        self.cuda_state = None

    @contextlib.contextmanager
    def fork(self):
        """Run the body on this stream; the default generator's state is restored afterwards."""
        saved = torch.get_rng_state()
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        saved_cuda = torch.cuda.get_rng_state() if use_cuda else None
        torch.set_rng_state(self.cpu_state)
        if use_cuda:
            if self.cuda_state is None:
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self.cuda_state)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            torch.set_rng_state(saved)
            if use_cuda:
                self.cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


class ShardedRandom(nn.Module):
    """Calls ``op(*args, **kwargs)`` on the rank's sharded-region stream (see the module docstring)."""

    def __init__(self, op, *, tracker: TpRngTracker):
        super().__init__()
        self.op = op
        self.tracker = tracker

    def forward(self, *args, **kwargs):
        with self.tracker.fork():
            return self.op(*args, **kwargs)

    def meta_forward(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"op={self.op}, seed={self.tracker.seed}"
