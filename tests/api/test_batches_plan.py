"""What planning says and sizes for batches of any length (docs/batches.md), in one process:

- the Plan records which dims stay symbolic and their bound, round-trips through JSON and says it in
  its summary;
- a symbolic graph's pipeline edges carry their shape in the symbols (fit from runs at other lengths,
  checked against a compile at that length), and its size nodes are recomputed per stage, never sent;
- the memory calculator figures a symbolic plan's activations at the bound, equal to a plan compiled
  for the bound; the planner costs the model at the bound.
"""
from __future__ import annotations

import torch

import autopar
from autopar.ir.dynamic_shapes import SizeExpr, resolve_shape
from autopar.memory import estimate_memory
from autopar.models import build_model, lm_loss
from autopar.ops.p2p import RecvActivation
from autopar.options import CompileOptions
from autopar.passes.pipeline.pipeline_split import size_nodes
from autopar.plan_model import Plan
from autopar.planner.profile import profile_model

VOCAB = 128


def _tokens(seq: int, rows: int = 8):
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (rows, seq))


def _plan(seq: int, mesh, **options):
    torch.manual_seed(0)
    x = _tokens(seq)
    return autopar.plan(build_model("gpt_tiny"), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                        **options)


def test_the_plan_records_the_symbolic_dims_and_their_bound():
    plan = _plan(16, {"pp": 2}, dynamic_shapes="seq").plan
    (dim,) = plan.dynamic_dims
    assert (dim.label, dim.inputs, dim.low, dim.high) == ("seq", (("idx", 1), ("target", 1)), 2, 32)
    assert "dynamic dims: seq (dim 1 of idx, target) 2..32" in plan.summary()
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    auto = _plan(16, {"pp": 2}).plan
    assert not auto.dynamic_dims and auto.max_seq_len == 32
    assert "recaptures once with those dims symbolic (dynamic_shapes=auto), sequences up to 32" in auto.summary()


def test_symbolic_edges_carry_their_shape_and_size_nodes_are_not_sent():
    result = _plan(16, {"pp": 2}, dynamic_shapes="seq")
    twice = _plan(24, {"pp": 2}, dynamic_shapes="static")  # the oracle: compiled for 24 tokens
    stages = result.lowered[0].stages
    recvs = [m for m in stages[1].gm.modules() if isinstance(m, RecvActivation)]
    assert recvs and all(m.dims is not None and any(isinstance(d, SizeExpr) for d in m.dims) for m in recvs)
    symbol = result.plan.dynamic_dims and stages[0].dynamic[0].symbol
    fixed = {m.edge: m.shape for m in twice.lowered[0].stages[1].gm.modules() if isinstance(m, RecvActivation)}
    assert {m.edge: resolve_shape(m.dims, {symbol: 24}) for m in recvs} == fixed
    for stage in stages:  # every stage reads the length off its own inputs
        assert size_nodes(stage.gm), stage.stage
        assert not [e for e in stage.sends if e.dtype is None]


def test_memory_at_the_bound_equals_a_plan_compiled_for_the_bound():
    symbolic = estimate_memory(_plan(16, {"pp": 2, "tp": 2}, dynamic_shapes="seq"))
    at_bound = estimate_memory(_plan(32, {"pp": 2, "tp": 2}, dynamic_shapes="static"))
    example = estimate_memory(_plan(16, {"pp": 2, "tp": 2}, dynamic_shapes="static"))
    figures = lambda e: [r.activations for _, r in sorted(e.ranks.items())]  # noqa: E731
    assert figures(symbolic) == figures(at_bound) and figures(symbolic) != figures(example)
    assert "activations at the bound seq 32" in symbolic.summary()


def test_the_planner_costs_the_model_at_the_bound():
    model = build_model("gpt_tiny")
    flops = lambda seq, **o: [c.flops for c in profile_model(  # noqa: E731
        model, example_inputs=(_tokens(seq),), loss_fn=lm_loss, example_target=_tokens(seq),
        options=CompileOptions(**o)).chunks[1]]
    assert flops(16) == flops(32, dynamic_shapes="static") != flops(16, dynamic_shapes="static")
    assert flops(16, max_seq_len=24) == flops(24, dynamic_shapes="static")
