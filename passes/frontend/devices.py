"""Devices baked into a captured graph: one rule for every model, whoever wrote it.

``torch.export`` writes the device it traced on into the graph as constants: factory calls
(``arange(..., device=meta)``), copies (``aten.to.device(x, meta, ...)``, HF's
``inv_freq.to(device=x.device)``) and the ``aten._assert_tensor_metadata(..., device=meta)``
checks that accompany every ``.to``. A model built under ``torch.device("meta")`` therefore
produces a graph that asserts and allocates on the meta device, which neither the fake-tensor
analyses (they stand in CPU tensors for meta ones, :mod:`autopar.passes.frontend.shape_prop`) nor a rank
running real weights can execute.

The rule: a graph is device-neutral. Every device constant equal to the capture device is
rewritten to the graph's run device (CPU after capture; the rank's own device when
``autopar.compile`` places the graph on an accelerator), so ``.to(device=...)`` of a tensor
already there is a no-op and the assertions check the device the graph really runs on.
Nothing is special-cased per family or per op: every argument and keyword of every call node
is visited.

Example (a graph as export writes it for a model built on meta)::

    >>> graph = fx.Graph()
    >>> x = graph.placeholder("x")
    >>> ramp = graph.call_function(torch.ops.aten.arange.start, (0, 3), {"device": torch.device("meta")})
    >>> _ = graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, ramp)))
    >>> gm = fx.GraphModule(torch.nn.Module(), graph)
    >>> retarget_devices(gm, source=torch.device("meta"), target=torch.device("cpu"))
    1
    >>> graph_devices(gm), gm(torch.ones(3))
    ({device(type='cpu')}, tensor([1., 2., 3.]))
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

__all__ = ["retarget_devices", "graph_devices"]

log = logging.getLogger(__name__)


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _as_device(value) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    return None


def graph_devices(gm: fx.GraphModule) -> set[torch.device]:
    """Every device constant the call nodes of ``gm`` carry."""
    found: set[torch.device] = set()

    def visit(value):
        if isinstance(value, torch.device):
            found.add(value)
        return value

    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            fx.node.map_aggregate(node.args, visit)
            fx.node.map_aggregate(node.kwargs, visit)
    return found


def retarget_devices(gm: fx.GraphModule, *, source: torch.device, target: torch.device) -> int:
    """Rewrite every device constant equal to ``source`` into ``target``; returns the nodes changed."""
    source, target = torch.device(source), torch.device(target)
    changed = 0

    def swap(value):
        device = _as_device(value)
        return target if device is not None and _same(device, source) else value

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        args = fx.node.map_aggregate(node.args, swap)
        kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed += 1
    if changed:
        gm.recompile()
        log.info("graph devices: %d node(s) moved from %s to %s", changed, source, target)
    return changed
