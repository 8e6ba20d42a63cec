"""How a step counts the label tokens of a model's own loss: the ``num_items_in_batch`` input.

A loss that averages over label tokens (Hugging Face's, with padding at -100) is a mean per call.
Averaging the means of several microbatches (or dp replicas) equals one device's loss only when
each holds as many label tokens. ``transformers`` models take the step's token count as a
keyword, ``num_items_in_batch``: their loss is then the microbatch's sum divided by it. When a
model's ``forward`` takes that keyword and the batch carries ``labels``, capture adds it as one
more graph input (0-dim, float32) and :class:`~autopar.ir.captured_graph.ItemCount` says how the runtime counts it
(:mod:`autopar.runtime.execution.item_count`): the labels that are not ``ignore_index``, after the shift
the model's loss applies. The rule is the one ``transformers.Trainer`` uses: a loss that
``LOSS_MAPPING`` maps to ``ForCausalLMLoss``, in a model that is not an encoder-decoder, predicts
``labels[..., 1:]`` (shift 1); every other loss, and a model not from ``transformers``, counts
the labels as they are; a batch's own ``shift_labels`` are counted as they are. Capture then
corrects a shift of 0 from the graph, where the labels reach the loss through ``[..., 1:]``
(``passes/frontend/capture.py``: GPT-2's ``loss_type`` is None, its loss shifts).

Example::

    >>> import torch.nn as nn

from autopar.ir.captured_graph import NUM_ITEMS, ItemCount
    >>> class Model(nn.Module):
    ...     def forward(self, input_ids, labels=None, **kwargs): ...
    >>> item_count_spec(Model(), ("input_ids", "labels"))
    ItemCount(labels='labels', shift=0, ignore_index=-100, input='num_items_in_batch')
    >>> item_count_spec(nn.Linear(2, 2), ("input", "labels")) is None   # its forward takes no such keyword
    True
"""
from __future__ import annotations

import inspect

import torch.nn as nn

from autopar.ir.captured_graph import NUM_ITEMS, ItemCount

__all__ = ["item_count_spec", "LABELS"]

LABELS = "labels"
SHIFT_LABELS = "shift_labels"  # a batch's labels already shifted (padding-free collators)


def _takes_keyword(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in params)


def _loss_shifts_labels(model: nn.Module) -> bool:
    """transformers.Trainer's rule, on the first transformers model inside ``model`` (None: no shift)."""
    hf = next((m for m in model.modules() if hasattr(m, "loss_type") and hasattr(m, "config")), None)
    if hf is None:
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # a loss_type attribute of some other library
        return False
    causal = LOSS_MAPPING.get(getattr(hf, "loss_type", None)) is ForCausalLMLoss
    return causal and not getattr(hf.config, "is_encoder_decoder", False)


def item_count_spec(model: nn.Module, keywords: tuple[str, ...] | None) -> ItemCount | None:
    """How to count ``num_items_in_batch`` for ``model`` on a dict batch with ``keywords``; None: not taken."""
    if not keywords or LABELS not in keywords or NUM_ITEMS in keywords:
        return None
    if not _takes_keyword(model, NUM_ITEMS):
        return None
    if SHIFT_LABELS in keywords:
        return ItemCount(labels=SHIFT_LABELS, shift=0)
    return ItemCount(labels=LABELS, shift=1 if _loss_shifts_labels(model) else 0)
