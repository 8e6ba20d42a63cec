"""The checkpointed region a recompute pass leaves in a stage graph: :class:`Recompute`, a ``call_module`` node.

:mod:`autopar.passes.pipeline.recompute` moves each region's nodes into a GraphModule owned by one
:class:`Recompute`; at run time the module runs that body through ``torch.utils.checkpoint``
(non-reentrant, RNG state preserved): ``"full"`` keeps only the region's inputs, ``"selective"`` also
stores the outputs of the ops in :data:`SAVED_OPS` and recomputes every other op in backward. The
runtime's memory probes find the regions with :func:`recompute_modules` and observe what they hold.

Example::

    >>> import torch, torch.fx as fx
    >>> body = fx.symbolic_trace(lambda x: (x.sin() * 2,))
    >>> region = Recompute(body, mode="full")
    >>> x = torch.ones(3, requires_grad=True)
    >>> region(x)[0].sum().backward()
    >>> x.grad.tolist() == (2 * torch.ones(3).cos()).tolist()
    True
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "Recompute", "recompute_modules"]

#: Ops whose outputs selective recompute stores (dispatcher-level names, after linear decomposes).
SAVED_OPS = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution",
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
)


def _selective_policy(ctx, op, *args, **kwargs):
    """Store the outputs of matmuls and fused attention; recompute every other op."""
    name = str(getattr(op, "_overloadpacket", op))
    return CheckpointPolicy.MUST_SAVE if name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class Recompute(nn.Module):
    """A checkpointed region: ``body`` runs once forward and again (partly) in backward.

    ``observer``, when set, is called with every tensor the region holds for backward (its
    inputs, and under selective recompute the stored op outputs); memory probes use it.
    """

    def __init__(self, body: fx.GraphModule, *, mode: str):
        super().__init__()
        self.body = body
        self.mode = mode
        self.observer = None
        self._stored = None  # selective: the checkpoint's store of op outputs, while observed

    def _contexts(self):
        fwd, rec = create_selective_checkpoint_contexts(_selective_policy)
        if self.observer is not None:
            self._stored = fwd.storage  # filled while the forward runs
        return fwd, rec

    def forward(self, *args):
        return self.run(self.body, *args)

    def run(self, body, *args):
        """Run ``body`` (this region's graph, or an interpreter of it) checkpointed as the mode says."""
        if not torch.is_grad_enabled():
            return body(*args)
        extra = {"context_fn": self._contexts} if self.mode == "selective" else {}
        self._stored = None
        out = checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True, **extra)
        if self.observer is not None:
            held = [a for a in args if isinstance(a, torch.Tensor)]
            for outputs in (self._stored or {}).values():  # {op key: {call index: stored output}}
                for value in (outputs.values() if isinstance(outputs, dict) else outputs):
                    held += list(_tensors(value))
            self.observer(held)
        self._stored = None
        return out

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, nodes={sum(1 for n in self.body.graph.nodes if n.op == 'call_function')}"


def _tensors(value):
    """Tensors inside a selective-checkpoint storage entry (tuples, version wrappers)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "val"):
        yield from _tensors(value.val)


def recompute_modules(gm: nn.Module) -> list[Recompute]:
    """Every Recompute region of a stage graph, in order."""
    return [m for m in gm.modules() if isinstance(m, Recompute)]
