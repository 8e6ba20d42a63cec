"""The label-token count of a step: for a model's own loss that divides its sum by it (``num_items_in_batch``), and
the weights of a token-mean ``loss_fn``'s microbatch losses.

A step of ``m`` microbatches on each of ``dp`` replicas reduces its microbatch losses by their
mean (the executor scales each backward by 1/m, the dp gradient sync averages), as a loss that
is itself a mean needs. A loss that sums over its label tokens and divides by ``count`` (what
``transformers`` models do with ``num_items_in_batch``) then equals one device's loss over the
whole batch, ``sum / N``, when ``count = N / (m · dp)``, with ``N`` the non-ignored labels of all
microbatches on all replicas: the mean over ``m · dp`` microbatches of ``sum_i · m · dp / N`` is
``sum / N``, and so are the gradients. This is ``transformers.Trainer``'s own convention with
``average_tokens_across_devices`` (the global count, and the loss scaled by the number of
processes whose gradients DDP averages). ``N`` comes from one all-reduce of one count per update
over dp; every pp and tp rank of a replica reads the same batch and counts the same.

An update that takes fewer microbatches than the step (PipeDream and PipeMare update after each
one) counts per update: ``per_update`` microbatches, ``count = N_update / (per_update · dp)``.

A ``loss_fn`` that is a token mean (``passes/frontend/mean_loss.py``: ``F.cross_entropy`` on the target)
computes ``mean_i = sum_i / n_i`` per microbatch; :func:`add_loss_weights` gives each microbatch
the weight ``n_i · m · dp / N`` and the executor multiplies its loss by it, which is the same
``sum_i · m · dp / N``; under an asynchronous schedule, per update, as for the model's own loss.

Example (one process, no dp)::

    >>> import torch
    >>> from autopar.ir.captured_graph import ItemCount
    >>> batches = [{"labels": torch.tensor([[1, 2, -100]])}, {"labels": torch.tensor([[3, 4, 5]])}]
    >>> add_item_counts(batches, ItemCount(labels="labels", shift=1), per_update=2)
    >>> [float(b["num_items_in_batch"]) for b in batches]   # 1 + 2 label tokens after the shift, / 2 microbatches
    [1.5, 1.5]
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ir.captured_graph import ItemCount

__all__ = ["add_item_counts", "add_loss_weights", "count_labels", "weighted_loss"]


def count_labels(labels: torch.Tensor, spec: ItemCount) -> torch.Tensor:
    """The label tokens of one microbatch that the model's loss counts (int64, 0-dim)."""
    kept = labels[..., spec.shift:] if spec.shift else labels
    return (kept != spec.ignore_index).sum()


def _update_counts(microbatches: list[dict], spec: ItemCount, *, per_update: int, dp_size: int, dp_group, guard,
                   purpose: str, riders: torch.Tensor | None = None):
    """(each microbatch's count, each update's count summed over dp, ``riders`` summed over dp): one
    all-reduce over ``dp_group`` when ``dp_size > 1`` (``guard``: the program's
    :class:`~autopar.ops.comm_guard.CommGuard`, which bounds the wait and names the rank).
    ``riders``: more numbers (float64) that take the same all-reduce (runtime/execution/batch_agreement.py)."""
    assert len(microbatches) % per_update == 0, (len(microbatches), per_update)
    counts = torch.stack([count_labels(mb[spec.labels], spec) for mb in microbatches])
    totals = counts.view(-1, per_update).sum(dim=1)
    if dp_size > 1:
        if riders is None:
            guard.run("all_reduce", dist.all_reduce, totals, group=dp_group, purpose=purpose)
        else:
            both = torch.cat([totals.double(), riders.double().to(totals.device)])
            guard.run("all_reduce", dist.all_reduce, both, group=dp_group, purpose=purpose)
            totals, riders = both[:len(totals)].round().long(), both[len(totals):]
    return counts, totals, riders


def add_item_counts(microbatches: list[dict], spec: ItemCount, *, per_update: int, dp_size: int = 1,
                    dp_group=None, guard=None, riders: torch.Tensor | None = None):
    """Set ``microbatch[spec.input]`` to its update's global count / (``per_update`` · ``dp_size``), in place
    (collective over ``dp_group`` when ``dp_size > 1``); returns ``riders`` summed over dp."""
    _, totals, riders = _update_counts(microbatches, spec, per_update=per_update, dp_size=dp_size, dp_group=dp_group,
                                       guard=guard, riders=riders,
                                       purpose="the step's label tokens (num_items_in_batch, summed over dp)")
    values = totals.double() / (per_update * dp_size)
    device = microbatches[0][spec.labels].device
    for i, mb in enumerate(microbatches):
        mb[spec.input] = values[i // per_update].to(torch.float32).to(device)
    return riders


def add_loss_weights(microbatches: list[dict], spec: ItemCount, *, per_update: int | None = None, dp_size: int = 1,
                     dp_group=None, guard=None, riders: torch.Tensor | None = None):
    """Set ``microbatch[spec.input]`` to ``n_i · m · dp / N``, in place (``passes/frontend/mean_loss.py``); returns
    ``riders`` summed over dp.

    ``n_i``: the microbatch's counted target entries; ``N``: its update's, over the update's ``m``
    microbatches (``per_update``; all of them when None) and every dp rank (collective over
    ``dp_group`` when ``dp_size > 1``). An update's loss, the mean over its microbatches and dp of
    ``mean_i · weight_i``, is then one device's token mean over the update's whole batch (0
    weight, and a 0 loss, for a microbatch without counted tokens).
    """
    per_update = per_update or len(microbatches)
    counts, totals, riders = _update_counts(
        microbatches, spec, per_update=per_update, dp_size=dp_size, dp_group=dp_group, guard=guard, riders=riders,
        purpose="the step's target tokens (the loss's token mean, summed over dp)")
    scale = per_update * dp_size / totals.double().clamp(min=1)
    device = microbatches[0][spec.labels].device
    for i, (mb, n) in enumerate(zip(microbatches, counts)):
        mb[spec.input] = (n.double() * scale[i // per_update]).to(torch.float32).to(device)
    return riders


def weighted_loss(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A microbatch's token-mean loss times its weight (:func:`add_loss_weights`); 0 where it has no tokens
    (its mean is 0 / 0)."""
    return torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
