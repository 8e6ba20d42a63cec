"""Tensor-parallel ops that communicate inside their own computation, as graph modules.

:class:`VocabParallelCrossEntropy` is the mean cross-entropy of logits sharded on the vocabulary
(this rank holds classes ``[vocab_start, vocab_end)``), computed without ever gathering them:

1. local max over the shard, all-reduce MAX: the global max ``m`` of each row;
2. ``sum(exp(x - m))`` over the shard and the target's shifted logit ``x[t] - m`` (non-zero only
   on the rank that owns ``t``), in one all-reduce SUM of both rows;
3. ``loss = log(sum_exp) - (x[t] - m)``, averaged (or summed: ``reduction="sum"``) over rows whose target
   is not ``ignore_index``.

Backward needs no communication: ``(softmax - onehot(t)) / num_valid`` on the local shard.

Under sequence parallelism, :class:`SpGatherLinear` is the f of a group of column linears fused
with them (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``): it all-gathers the
sequence shard, runs every linear on the gathered input, and saves only the *shard* for
backward, gathering it again there. The gathered input of the columns is then never stored,
which is what makes every activation of a block scale as 1/tp (Korthikanti et al. 2022).

Example (one process, world of one)::

    >>> ce = VocabParallelCrossEntropy(axis="tp", size=1, vocab_start=0, vocab_end=8)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.ir.shard_layout import ShardLayout
from autopar.ops.collectives import (Comm, GraphCollective, _CopyToRegion, all_gather_dim, issue,
                                         reduce_scatter_dim)

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "SpGatherLinear", "TpGradSum",
           "TpGroupGradSum", "local_shard"]


def local_shard(x: torch.Tensor, *, dim: int, rank: int, size: int, chunks: int = 1, parts: int = 0,
                inner: int | None = None, blocks: tuple = ()) -> torch.Tensor:
    """Rank ``rank``'s piece of ``x`` over ``size`` ranks as :class:`~autopar.ir.shard_layout.ShardLayout`
    ``(dim, chunks, parts, inner, blocks)`` cuts it, a new tensor.

    In a graph it cuts a value without a gradient (a mask, ALiBi slopes) that a region reads sharded.
    """
    return ShardLayout(dim, chunks, parts, inner, blocks).cut(x, rank=rank, size=size)


class TpGradSum(GraphCollective):
    """Identity forward; backward sums the gradient over tp.

    Sits on a replicated value read inside a tensor-parallel region other than through a column
    (a q/k norm's weight read on this rank's heads): each rank's gradient of it is partial.
    """

    kind = "all_reduce(backward)"

    def forward(self, x):
        return _CopyToRegion.apply(x, self._require_group(), self.guard, f"the backward of {self.purpose}")

    def comm(self, in_bytes, out_bytes):
        return [Comm("backward", "all_reduce", in_bytes)]


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, rank, size, group, guard, purpose):
        ctx.args = (dim, blocks, rank, size, group, guard, purpose)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dim, blocks, rank, size, group, guard, purpose = ctx.args
        grad = grad.contiguous().clone()
        offset = 0
        for local, parts in blocks:
            if parts:
                piece = grad.narrow(dim, offset, local)
                slots = grad.new_zeros((parts, *piece.shape))
                mine = ShardLayout(dim, parts=parts).piece_of(rank, size)
                slots[mine] = piece
                issue("all_reduce", dist.all_reduce, slots, group=group, guard=guard, purpose=purpose)
                piece.copy_(slots[mine])
            offset += local
        return grad, None, None, None, None, None, None, None


class TpGroupGradSum(GraphCollective):
    """Identity forward; backward sums the gradient over the ranks holding the same piece.

    A parameter block cut in ``parts`` < tp pieces (a kv head replicated over tp / parts ranks, rank
    r holding piece ``r * parts // tp``) gets a partial gradient on each rank (its query heads
    only). ``blocks``: (local size, parts) along ``dim``, parts 0 for a block cut tp ways (no sum).
    One all-reduce over tp of ``parts`` slots per such block, each rank writing its own, sums every
    group at once.
    """

    kind = "all_reduce(backward)"

    def __init__(self, *, axis: str, size: int, dim: int, blocks, rank: int):
        super().__init__(axis=axis, size=size)
        self.dim = dim
        self.blocks = tuple(tuple(b) for b in blocks)
        self.rank = rank

    def forward(self, x):
        return _GroupSum.apply(x, self.dim, self.blocks, self.rank, self.size, self._require_group(), self.guard,
                               f"the backward of {self.purpose}")

    def comm(self, in_bytes, out_bytes):
        total = sum(local for local, _ in self.blocks) or 1
        return [Comm("backward", "all_reduce", in_bytes * local * parts // total)
                for local, parts in self.blocks if parts]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, dim={self.dim}, blocks={list(self.blocks)}"


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group, guard, purpose, reduction="mean"):
        ctx.dtype = logits.dtype
        logits = logits.float()  # low-precision logits: sum the exponentials in fp32, as Megatron does
        local_vocab = logits.shape[-1]
        row_max = logits.detach().amax(dim=-1)
        issue("all_reduce", dist.all_reduce, row_max, op=dist.ReduceOp.MAX, group=group, guard=guard,
              purpose=f"the row max of {purpose}")
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        owned = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = torch.where(owned, target - vocab_start, torch.zeros_like(target))
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * owned
        sums = torch.stack([exp.sum(dim=-1), picked])
        issue("all_reduce", dist.all_reduce, sums, group=group, guard=guard, purpose=f"the sums of {purpose}")
        sum_exp, target_logit = sums[0], sums[1]
        valid = target != ignore_index
        count = valid.sum() if reduction == "mean" else torch.ones((), dtype=torch.long, device=valid.device)
        loss = (((sum_exp.log() - target_logit) * valid).sum() / count).to(ctx.dtype)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, in place: the only thing backward needs
        ctx.save_for_backward(exp, local_target, owned & valid, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, hit, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_target.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int,
                                 ignore_index: int = -100, group=None, guard=None,
                                 purpose: str = "the vocab-parallel cross-entropy",
                                 reduction: str = "mean") -> torch.Tensor:
    """Mean (or ``reduction="sum"``) cross-entropy of ``logits[N, local_vocab]`` (classes from ``vocab_start``)
    against ``target[N]``."""
    return _VocabParallelCE.apply(logits, target, vocab_start, ignore_index, group, guard, purpose, reduction)


class VocabParallelCrossEntropy(GraphCollective):
    """``cross_entropy(logits, target)`` (mean) on vocabulary-sharded logits; see the module docstring."""

    kind = "all_reduce(max)+all_reduce(sum), forward"

    def __init__(self, *, axis: str, size: int, vocab_start: int, vocab_end: int, ignore_index: int = -100,
                 reduction: str = "mean"):
        super().__init__(axis=axis, size=size)
        self.vocab_start = vocab_start
        self.vocab_end = vocab_end
        self.ignore_index = ignore_index
        self.reduction = reduction  # "sum": a loss that divides by num_items_in_batch itself

    def forward(self, logits, target):
        return vocab_parallel_cross_entropy(logits, target, vocab_start=self.vocab_start,
                                            ignore_index=self.ignore_index, group=self._require_group(),
                                            guard=self.guard, purpose=self.purpose, reduction=self.reduction)

    def meta_forward(self, logits, target):
        return logits.new_empty(())

    def comm(self, in_bytes, out_bytes):
        row_bytes = in_bytes // max(1, self.vocab_end - self.vocab_start)  # one value per row
        return [Comm("forward", "all_reduce", row_bytes), Comm("forward", "all_reduce", 2 * row_bytes)]

    def extra_repr(self) -> str:
        return (f"axis={self.axis!r}, size={self.size}, vocab=[{self.vocab_start}, {self.vocab_end}), "
                f"ignore_index={self.ignore_index}"
                + (f", reduction={self.reduction!r}" if self.reduction != "mean" else ""))


class _GatherLinears(torch.autograd.Function):
    """``[linear(all_gather(x), w_i, b_i)]``, saving ``x`` (the shard), not the gathered input."""

    @staticmethod
    def forward(ctx, x, dim, group, guard, purpose, has_bias, *weights_and_biases):
        full = all_gather_dim(x, dim, group, guard, purpose)
        params, i = [], 0
        for bias in has_bias:
            params.append((weights_and_biases[i], weights_and_biases[i + 1] if bias else None))
            i += 2 if bias else 1
        ctx.dim, ctx.group, ctx.has_bias, ctx.guard, ctx.purpose = dim, group, has_bias, guard, purpose
        ctx.save_for_backward(x, *[w for w, _ in params])
        return tuple(F.linear(full, w, b) for w, b in params)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_dim(x, ctx.dim, ctx.group, ctx.guard, f"the backward of {ctx.purpose}").reshape(
            -1, x.shape[-1])  # gathered again
        grad_full, out = None, []
        for g, w, bias in zip(grads, weights, ctx.has_bias):
            if g is None:
                out += [None] * (2 if bias else 1)
                continue
            g2 = g.reshape(-1, g.shape[-1])
            part = g2 @ w
            grad_full = part if grad_full is None else grad_full + part
            out.append(g2.t() @ full)
            if bias:
                out.append(g2.sum(dim=0))
        grad_x = None
        if grad_full is not None:
            shape = list(x.shape)
            shape[ctx.dim] *= dist.get_world_size(ctx.group)
            grad_x = reduce_scatter_dim(grad_full.reshape(shape), ctx.dim, ctx.group, ctx.guard,
                                        f"the backward of {ctx.purpose}")
        return (grad_x, None, None, None, None, None, *out)


class SpGatherLinear(GraphCollective):
    """Sequence-parallel f fused with its column linears; returns one output per linear.

    ``forward(x_shard, w_0[, b_0], w_1[, b_1], ...)``: all-gather on ``dim`` forward (the shard is
    saved, not the gathered input); backward all-gathers the shard again and reduce-scatters the
    summed input gradient.
    """

    kind = "all_gather(forward)+all_gather(recompute)+reduce_scatter(backward)"

    def __init__(self, *, axis: str, size: int, dim: int, has_bias: tuple[bool, ...]):
        super().__init__(axis=axis, size=size)
        self.dim = dim
        self.has_bias = tuple(has_bias)

    def forward(self, x, *weights_and_biases):
        return _GatherLinears.apply(x, self.dim, self._require_group(), self.guard, self.purpose, self.has_bias,
                                    *weights_and_biases)

    def meta_forward(self, x, *weights_and_biases):
        shape = list(x.shape)
        shape[self.dim] *= self.size
        outs, i = [], 0
        for bias in self.has_bias:
            outs.append(x.new_empty(shape[:-1] + [weights_and_biases[i].shape[0]]))
            i += 2 if bias else 1
        return tuple(outs)

    def comm(self, in_bytes, out_bytes):
        full = in_bytes * self.size
        return [Comm("forward", "all_gather", full), Comm("backward", "all_gather", full, recompute=True),
                Comm("backward", "reduce_scatter", full)]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, size={self.size}, dim={self.dim}, linears={len(self.has_bias)}"
