"""Shape propagation with fake tensors: run a graph on FakeTensors, node by node.

Meta-device tensors are faked as CPU tensors, so ops pick the same layouts (strides) that
torch.export's own fake run chose; a meta run would pick other strides and reject valid views.

Used after capture and after every transform (the pass manager re-propagates to check that a
rewritten graph is still consistent). autopar's own collective and p2p modules answer through
their ``meta_forward`` so a rewritten rank program propagates without a process group; one whose work the FLOP
counter cannot see through ``meta_forward`` (context parallelism's attention) tells it by ``meta_flops``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
import torch.utils._pytree as pytree

__all__ = ["MetaRun", "run_on_meta", "to_fake"]


def to_fake(value: Any, mode: FakeTensorMode) -> Any:
    """Every tensor in ``value`` as a fake tensor of its shape, stride and dtype (meta -> cpu)."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor):
            return t
        device = torch.device("cpu") if t.is_meta else t.device
        with mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)

    return pytree.tree_map_only(torch.Tensor, convert, value)


class MetaRun(fx.Interpreter):
    """Interpreter that executes on meta tensors and calls ``on_node(node, value, flops)``.

    The fake mode and one FLOP counter are entered once for the whole run; a node's FLOPs are what
    the counter's total gained while it ran (entering a counter per node cost about an eighth of the run).
    """

    def __init__(self, gm: fx.GraphModule, on_node: Callable[[fx.Node, Any, int], None],
                 mode: FakeTensorMode):
        super().__init__(gm, garbage_collect_values=True)
        self.on_node = on_node
        self.mode = mode
        self._counter: FlopCounterMode | None = None

    def run(self, *args, **kwargs) -> Any:
        with self.mode, FlopCounterMode(display=False) as counter:
            self._counter = counter
            try:
                return super().run(*args, **kwargs)
            finally:
                self._counter = None

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output"):
            value = super().run_node(n)
            flops = 0
        elif n.op == "get_attr":
            value = to_fake(super().run_node(n), self.mode)
            flops = 0
        else:
            before = self._counter.get_total_flops()
            value = self._run_call(n)
            flops = self._counter.get_total_flops() - before + self._own_flops(n)
        self.on_node(n, value, flops)
        return value

    def _own_flops(self, n: fx.Node) -> int:
        """The FLOPs a graph op module reports for itself (``meta_flops``), 0 for every other node."""
        counted = getattr(self.fetch_attr(n.target), "meta_flops", None) if n.op == "call_module" else None
        if counted is None:
            return 0
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return int(counted(*args, **kwargs))

    def _run_call(self, n: fx.Node) -> Any:
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            meta_forward = getattr(module, "meta_forward", None)
            if meta_forward is not None:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                return meta_forward(*args, **kwargs)
        return super().run_node(n)


def run_on_meta(gm: fx.GraphModule, inputs: tuple, on_node: Callable[[fx.Node, Any, int], None]):
    """Run ``gm`` on fake copies of ``inputs``, reporting every node's value and FLOPs."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with torch.no_grad():
        return MetaRun(gm, on_node, mode).run(*to_fake(tuple(inputs), mode))
