"""Analyses: record shapes, dtypes, FLOPs, activation bytes, module paths and parameter ownership.

These passes write node.meta and never change the graph. Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> from autopar.ir.meta_keys import COST, get_meta
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> [(n.name, get_meta(n, COST).flops) for n in gm.graph.nodes if n.op == "call_function"][4:6]
    [('layer_norm', 0), ('linear', 1572864)]
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.ir.graph_names import MODEL_PREFIX
from autopar.ir.meta_keys import (
    COST, MODULE, PARAM, TENSOR, ModuleInfo, NodeCost, ParamInfo, TensorInfo, set_meta,
)
from autopar.passes.lowering_state import LoweringState
from autopar.passes.frontend.shape_prop import run_on_meta

__all__ = ["annotate", "annotate_graph", "annotate_tensors", "annotate_modules", "annotate_params", "module_path_of"]

_INDEX = re.compile(r"^\d+$")


def _tensor_info(value) -> TensorInfo:
    if isinstance(value, (tuple, list)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        first = tensors[0] if tensors else None
        return TensorInfo(tuple(first.shape) if first is not None else None,
                          first.dtype if first is not None else None, nbytes)
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(value.shape), value.dtype, value.numel() * value.element_size())
    return TensorInfo(None, None, 0)


def _attention_flops(node: fx.Node, value) -> int:
    """Forward FLOPs of scaled_dot_product_attention, which the CPU flop counter misses.

    Two batched matmuls, QK^T and PV: 4·b·h·s_q·s_k·d (torch's convention for sdpa kernels).
    """
    q, k = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return 0
    *batch, s_q, d = q.shape
    s_k = k.shape[-2]
    b = 1
    for size in batch:
        b *= size
    return 4 * b * s_q * s_k * d


_VIEW_OPS = frozenset({"view", "_unsafe_view", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze",
                       "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "alias",
                       "detach", "as_strided", "narrow", "getitem", "flatten", "unflatten"})


def _is_view(node: fx.Node) -> bool:
    """Ops whose output aliases their input: they hold no activation memory of their own."""
    import operator
    if node.target is operator.getitem:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__ in _VIEW_OPS


def annotate_tensors(gm: fx.GraphModule, *, example_inputs: tuple) -> fx.GraphModule:
    """Write ``autopar.tensor`` and ``autopar.cost`` on every node by running the graph on meta."""

    def record(node: fx.Node, value, flops: int) -> None:
        info = _tensor_info(value)
        if flops == 0 and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            flops = _attention_flops(node, value)
        set_meta(node, TENSOR, info)
        is_activation = node.op in ("call_function", "call_module", "call_method") and not _is_view(node)
        set_meta(node, COST, NodeCost(int(flops), info.nbytes if is_activation else 0))
        node.meta["val"] = value if isinstance(value, torch.Tensor) else node.meta.get("val")

    run_on_meta(gm, example_inputs, record)
    return gm


def module_path_of(node: fx.Node) -> str:
    """The innermost module path recorded for ``node`` ('' for root-level code)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _unit_of(path: str) -> str:
    """The pipeline unit of a module path: the first list element (``model.blocks.3``) or top child."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    prefix = MODEL_PREFIX.split(".")
    if parts[: len(prefix)] == prefix and len(parts) > len(prefix):
        return ".".join(parts[: len(prefix) + 1])
    return path


def annotate_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """Write ``autopar.module``: each call node's module path and its pipeline unit."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    units = [_unit_of(module_path_of(n)) for n in calls]
    for node, unit in zip(calls, _fill_block_gaps(units)):
        set_meta(node, MODULE, ModuleInfo(path=module_path_of(node), unit=unit))
    return gm


def _fill_block_gaps(units: list[str]) -> list[str]:
    """Nodes between two nodes of the same block belong to that block.

    symbolic_trace records module paths only for leaf modules, so a block's own code (views,
    attention, residual adds) comes back as root-level; its neighbours say which block it is in.
    """
    filled = list(units)
    last_block: dict[str, int] = {}
    for i, unit in enumerate(units):
        if _INDEX.match(unit.rsplit(".", 1)[-1] if unit else ""):
            j = last_block.get(unit)
            if j is not None and all(not _INDEX.match(u.rsplit(".", 1)[-1] if u else "")
                                     for u in units[j + 1:i]):
                filled[j + 1:i] = [unit] * (i - j - 1)
            last_block[unit] = i
    return filled


def _alias_groups(module: nn.Module, prefix: str) -> dict[str, tuple[str, ...]]:
    """Every parameter/buffer name mapped to all names of the same tensor (tied weights)."""
    by_id: dict[int, list[str]] = defaultdict(list)
    named = list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        by_id[id(tensor)].append(f"{prefix}{name}")
    return {name: tuple(names) for names in by_id.values() for name in names}


def annotate_params(gm: fx.GraphModule, *, model: nn.Module | None = None) -> fx.GraphModule:
    """Write ``autopar.param`` on get_attr nodes: name, tied aliases, size and the modules using it."""
    groups = _alias_groups(gm, "")
    if model is not None:  # the user's model knows every alias, the graph only the ones it kept
        groups.update(_alias_groups(model, f"{MODEL_PREFIX}."))
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        tensor = _fetch(gm, node.target)
        users = tuple(sorted({module_path_of(u) for u in node.users}))
        set_meta(node, PARAM, ParamInfo(name=node.target, aliases=groups.get(node.target, (node.target,)),
                                        is_parameter=isinstance(tensor, nn.Parameter),
                                        numel=tensor.numel(), used_by_modules=users))
    return gm


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def annotate_graph(st: LoweringState) -> LoweringState:
    """The analysis pass after capture: :func:`annotate` of ``st.gm`` on the inputs it runs on, with the
    model it was captured from (its tied weights)."""
    annotate(st.gm, example_inputs=st.example_args, model=st.source.model if st.source is not None else None)
    return st


def annotate(gm: fx.GraphModule, *, example_inputs: tuple, model: nn.Module | None = None):
    """All analyses in order: tensors and costs, module paths, parameter ownership."""
    annotate_tensors(gm, example_inputs=example_inputs)
    annotate_modules(gm)
    annotate_params(gm, model=model)
    return gm
