"""Capture in bf16 (``precision="bf16"``): the model the compiler traces, as bf16 code.

:func:`low_precision_copy` gives capture a copy of the user's model whose floating parameters and
buffers are bf16, with a pre-hook casting floating inputs to bf16, so the captured graph is the
model as bf16 code: a deliberate ``x.float()`` stays fp32 and ``.type_as(x)`` becomes bf16. The
original (fp32) model is untouched; the runtime cuts its fp32 master weights from it
(:mod:`autopar.runtime.state.mixed_precision`).

Example::

    >>> import torch
    >>> low = low_precision_copy(torch.nn.Linear(2, 2))
    >>> low.weight.dtype, low(torch.ones(1, 2)).dtype
    (torch.bfloat16, torch.bfloat16)
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn

from autopar.errors import PlanError

__all__ = ["low_precision_copy"]


def low_precision_copy(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A copy of ``model`` with floating parameters and buffers in ``dtype``; the original is untouched."""
    memo: dict[int, object] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo or not tensor.is_floating_point():
            continue
        if tensor.dtype not in (torch.float32, dtype):
            raise PlanError(f"precision='bf16' expects an fp32 model, found a {tensor.dtype} tensor",
                            where="the model's parameters/buffers",
                            fix="build the model in fp32 (autopar keeps fp32 masters itself) or use precision='fp32'")
        low = tensor.detach().to(dtype)
        memo[id(tensor)] = nn.Parameter(low, requires_grad=tensor.requires_grad) if isinstance(
            tensor, nn.Parameter) else low
    low_model = copy.deepcopy(model, memo)
    low_model.register_forward_pre_hook(functools.partial(_cast_inputs, dtype=dtype))
    return low_model


def _cast_inputs(module: nn.Module, args: tuple, *, dtype: torch.dtype) -> tuple:
    """Floating inputs enter the bf16 model as bf16 (a visible cast at the start of the graph)."""
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
