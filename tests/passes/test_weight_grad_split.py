"""passes/pipeline/weight_grad_split.py and the executor's split backward (B, then W) in one process.

The stage graph is written by hand: a linear with bias, then two projections of one input (q and
k, one level), then a tied weight read a second time at the end, as a tied embedding and head are.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.ir.stage_graph import StageGraph
from autopar.passes.pipeline.weight_grad_split import expose_stage_weight_uses
from autopar.runtime.execution.executor import _backward_input, _backward_weight

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
    stage = expose_stage_weight_uses(_stage())
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
    stage = expose_stage_weight_uses(_stage())
    out = stage.gm(x)
    saved = _backward_input(stage, out, 1, channel=None, microbatch=0)
    per_use = _per_use_weight_grads(stage, saved)
    _backward_weight(stage, saved)
    for name in NAMES:
        grad = stage.gm.get_parameter(name).grad
        assert torch.equal(grad, per_use[name]), name
        # a group that let one use's gradient reach another's weight would count it twice
        torch.testing.assert_close(grad, reference.gm.get_parameter(name).grad, rtol=1e-6, atol=1e-6)


def _run(stage, actions: str, x_batches):
    from autopar.ops.p2p import P2PChannel
    from autopar.runtime.execution.executor import run_actions
    from autopar.runtime.schedules.action import Action
    parsed = tuple(Action(int(a[0]), a[1], int(a[2:])) for a in actions.split())
    channel = P2PChannel(rank=0, stage_to_rank={0: 0})
    run_actions(parsed, stages={0: stage}, microbatches=[{"x": x} for x in x_batches], channel=channel, train=True)


def test_stage_sending_no_gradient_upstream_runs_whole_backward_at_w():
    """The first stage's B has nobody waiting for it: B only keeps the outputs, W runs the whole backward."""
    xs = [torch.randn(4, 8) for _ in range(3)]
    reference = _stage()
    for x in xs:
        (reference.gm(x)[0] / len(xs)).backward()
    stage = expose_stage_weight_uses(_stage())
    assert stage.weight_uses.num_received == 0
    _run(stage, "0F0 0F1 0F2 0B0 0B1 0B2", xs)
    assert all(stage.gm.get_parameter(n).grad is None for n in NAMES)  # B computed nothing
    stage = expose_stage_weight_uses(_stage())
    _run(stage, "0F0 0F1 0B0 0W0 0F2 0B1 0B2 0W1 0W2", xs)
    for name in NAMES:
        torch.testing.assert_close(stage.gm.get_parameter(name).grad, reference.gm.get_parameter(name).grad,
                                   rtol=1e-6, atol=1e-7)


def test_weight_gradients_of_several_microbatches_add_in_place_into_one_owned_sum():
    """W's sums equal a fresh sum per microbatch, and a gradient shared by two parameters stays unchanged."""
    from autopar.runtime.execution.executor import _accumulate
    shared = torch.ones(3)
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    _accumulate(a, [(0, shared)])
    _accumulate(b, [(0, shared)])
    for k in range(1, 4):
        _accumulate(a, [(k, torch.full((3,), float(k)))])
    assert torch.equal(a.grad, torch.full((3,), 7.0))
    assert torch.equal(b.grad, torch.ones(3)) and torch.equal(shared, torch.ones(3))
