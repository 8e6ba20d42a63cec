"""The captured program the lowering starts from and the runtime reads: :class:`CapturedGraph`.

Capture (:mod:`autopar.passes.frontend.capture`) writes it. Besides the graph it says how the step fills the
inputs capture added: :class:`ItemCount`, how a step counts the label tokens a model's own loss divides by
(``num_items_in_batch``, :mod:`autopar.passes.frontend.item_count`) or a token-mean ``loss_fn`` weighs its
microbatches by (:data:`LOSS_WEIGHT`, :mod:`autopar.passes.frontend.mean_loss`); the runtime counts them
(:mod:`autopar.runtime.execution.item_count`).

Example::

    >>> ItemCount(labels="labels", shift=1)
    ItemCount(labels='labels', shift=1, ignore_index=-100, input='num_items_in_batch')
    >>> ItemCount(labels="target", shift=0, input=LOSS_WEIGHT).input
    'autopar_loss_weight'
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.ir.dynamic_shapes import DynamicDim

__all__ = ["CapturedGraph", "ItemCount", "NUM_ITEMS", "LOSS_WEIGHT"]

NUM_ITEMS = "num_items_in_batch"  # the keyword transformers' losses divide their sum by
LOSS_WEIGHT = "autopar_loss_weight"  # the microbatch's key for its loss weight (runtime/execution/item_count.py)


@dataclass(frozen=True)
class ItemCount:
    """Count ``batch[labels][..., shift:] != ignore_index`` over the step; the graph reads it as ``input``."""

    labels: str
    shift: int
    ignore_index: int = -100
    input: str = NUM_ITEMS


@dataclass
class CapturedGraph:
    """The captured program: the graph, its input names and how to rebuild the output tree."""

    gm: fx.GraphModule
    input_names: tuple[str, ...]
    out_spec: pytree.TreeSpec
    has_loss: bool
    mode: str
    keywords: tuple[str, ...] | None = None  # the inputs are the model's keyword arguments (a dict batch)
    has_target: bool = False  # a ``target`` input follows the model's (loss_fn given)
    # the model's own loss reads the step's label-token count: a last model input the runtime fills
    item_count: ItemCount | None = None
    extra_args: tuple = ()  # example values of the inputs capture added (the count), in input order
    # a loss_fn that is a token mean of the target: each microbatch's loss weighted by its tokens
    # (passes/frontend/mean_loss.py; set by the lowering)
    loss_weight: ItemCount | None = None
    # the input dims the graph keeps symbolic (passes/frontend/dynamic_capture.py): it runs any size of them
    dynamic: tuple[DynamicDim, ...] = ()
