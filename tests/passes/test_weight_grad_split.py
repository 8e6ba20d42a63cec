"""passes/weight_grad_split.py and the executor's split backward (B, then W) in one process.

The stage graph is written by hand: a linear with bias, then two projections of one input (q and
k, one level), then a tied weight read a second time at the end, as a tied embedding and head are.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.passes.pipeline_split import StageGraph
from autopar.passes.weight_grad_split import expose_weight_uses
from autopar.runtime.executor import _backward_input, _backward_weight

aten = torch.ops.aten
NAMES = ("w_in", "b_in", "w_q", "w_k", "w_tied")


def _stage() -> StageGraph:
    torch.manual_seed(0)
    root = torch.nn.Module()
    for name, shape in zip(NAMES, [(8, 8), (8,), (8, 8), (8, 8), (8, 8)]):
        setattr(root, name, torch.nn.Parameter(torch.randn(shape) * 0.3))
    g = fx.Graph()
    x = g.placeholder("x")
    w_in, b_in, w_q, w_k, w_tied = (g.get_attr(n) for n in NAMES)
    h = g.call_function(aten.relu.default, (g.call_function(aten.linear.default, (x, w_in, b_in)),))
    h = g.call_function(aten.mm.default, (h, w_tied))  # the tied weight's first use
    q = g.call_function(aten.linear.default, (h, w_q))
    k = g.call_function(aten.linear.default, (h, w_k))
    scores = g.call_function(aten.mul.Tensor, (q, k))
    out = g.call_function(aten.mm.default, (scores, w_tied))  # its second use, three levels later
    loss = g.call_function(aten.sum.default, (g.call_function(operator.mul, (out, out)),))
    g.output((loss,))
    return StageGraph(stage=0, gm=fx.GraphModule(root, g), input_names=("x",), param_names=NAMES, is_last=True)


def test_uses_are_grouped_by_level():
    stage = expose_weight_uses(_stage())
    layout = stage.weight_uses
    assert layout.params == ("w_in", "b_in", "w_q", "w_k", "w_tied", "w_tied")
    levels = [sorted(layout.params[i] for i in group) for group in layout.groups]
    # weight and bias of one linear together; q and k (one input) together; the tied weight twice
    assert levels == [["b_in", "w_in"], ["w_tied"], ["w_k", "w_q"], ["w_tied"]]
    assert sorted(i for group in layout.groups for i in group) == list(range(6))


def _per_use_weight_grads(stage, saved) -> dict[str, torch.Tensor]:
    """One autograd.grad per use, summed in use order: what W computed before uses were grouped."""
    uses, aliases, grads = saved
    out: dict[str, torch.Tensor] = {}
    for use, alias, grad, target in zip(uses, aliases, grads, stage.weight_uses.params):
        (dw,) = torch.autograd.grad(use, alias, grad, retain_graph=True)
        out[target] = dw if target not in out else out[target] + dw
    return out


def test_grouped_weight_gradients_equal_one_call_per_use_and_full_backward():
    x = torch.randn(4, 8)
    reference = _stage()
    reference.gm(x)[0].backward()
    stage = expose_weight_uses(_stage())
    out = stage.gm(x)
    saved = _backward_input(stage, out, 1, channel=None, microbatch=0)
    per_use = _per_use_weight_grads(stage, saved)
    _backward_weight(stage, saved)
    for name in NAMES:
        grad = stage.gm.get_parameter(name).grad
        assert torch.equal(grad, per_use[name]), name
        # a group that let one use's gradient reach another's weight would count it twice
        torch.testing.assert_close(grad, reference.gm.get_parameter(name).grad, rtol=1e-6, atol=1e-6)
