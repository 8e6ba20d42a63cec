"""passes/tp/collective_audit.py: collective counts and bytes per block equal the analytic figures.

Per block per microbatch (Korthikanti et al. 2022, section 4.2.2): tensor parallelism does
4 all-reduces of b·s·h values (2 forward, 2 backward); with sequence parallelism 4 all-gathers
and 4 reduce-scatters of b·s·h values (the same volume), plus 2 all-gathers repeated in
backward because the columns save only the sequence shard of their input.
"""
from __future__ import annotations

import pytest

from autopar.passes.tp.collective_audit import audit_collectives, format_audit, per_unit, wire_bytes

from graph_runner import planned

VOCAB = (("vocab_parallel", True),)
SP = VOCAB + (("sequence_parallel", True),)
BLOCK = {"gpt_tiny": "model.blocks.", "llama_tiny": "model.layers.", "plain_tiny": "model.h."}
MODELS = [("gpt_tiny", 2, ()), ("llama_tiny", 2, ()), ("plain_tiny", 2, ()),
          ("llama_tiny", 4, (("num_kv_heads", 4),))]


def _blocks(name, tp, overrides, options):
    model, x, _, result = planned(name, tp=tp, overrides=overrides, options=options)
    bsh = result.plan.microbatch_size * x.shape[1] * model.cfg.hidden * 4  # fp32 bytes
    table = per_unit(audit_collectives(result.graph(tp - 1)), recompute=True)
    blocks = {u: v for u, v in table.items() if u.startswith(BLOCK[name])}
    assert len(blocks) == model.cfg.num_layers
    return blocks, bsh


@pytest.mark.parametrize("name,tp,overrides", MODELS, ids=[f"{n}-tp{t}" for n, t, _ in MODELS])
def test_tensor_parallel_block_does_four_all_reduces_of_bsh(name, tp, overrides):
    blocks, bsh = _blocks(name, tp, overrides, VOCAB)
    for unit, ops in blocks.items():
        assert ops == {("forward", "all_reduce"): (2, bsh), ("backward", "all_reduce"): (2, bsh)}, unit


@pytest.mark.parametrize("name,tp,overrides", MODELS, ids=[f"{n}-tp{t}" for n, t, _ in MODELS])
def test_sequence_parallel_block_does_four_all_gathers_and_four_reduce_scatters(name, tp, overrides):
    blocks, bsh = _blocks(name, tp, overrides, SP)
    for unit, ops in blocks.items():
        assert ops == {("forward", "all_gather"): (2, bsh), ("backward", "reduce_scatter"): (2, bsh),
                       ("forward", "reduce_scatter"): (2, bsh), ("backward", "all_gather"): (2, bsh),
                       ("backward", "all_gather (recompute)"): (2, bsh)}, unit


def test_same_bytes_on_the_wire_with_and_without_sequence_parallelism():
    model, _, _, tp_only = planned("gpt_tiny", tp=2, options=VOCAB)
    _, _, _, with_sp = planned("gpt_tiny", tp=2, options=SP)

    def block_wire(result, recompute):
        return sum(wire_bytes(r) for r in audit_collectives(result.graph(0))
                   if r.unit.startswith("model.blocks.") and (recompute or not r.recompute))

    assert block_wire(with_sp, recompute=False) == block_wire(tp_only, recompute=True)
    assert block_wire(with_sp, recompute=True) == 1.25 * block_wire(tp_only, recompute=True)  # 2 of 8 again


def test_loss_and_embedding_collectives_are_listed_outside_the_blocks():
    _, _, _, result = planned("gpt_tiny", tp=2, options=VOCAB)
    records = audit_collectives(result.graph(0))
    loss = [r for r in records if r.module == "VocabParallelCrossEntropy"]
    assert [(r.direction, r.op) for r in loss] == [("forward", "all_reduce")] * 2
    rows = result.plan.microbatch_size * 16
    assert [r.nbytes for r in loss] == [rows * 4, 2 * rows * 4]  # max per row; (sum exp, target logit)
    assert "vocab_cross_entropy" in format_audit(records)
