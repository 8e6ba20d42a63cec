"""Token ids and positions past their tables: caught before any stage reads them, on every rank."""
from __future__ import annotations


import pytest
import torch

import autopar
from autopar.ir.meta_keys import INDEX_BOUND, get_meta
from autopar.models import build_model, lm_loss

import shared_groups as groups


def _bounds(gm) -> dict:
    return {n.name: get_meta(n, INDEX_BOUND) for n in gm.graph.nodes
            if n.op == "placeholder" and get_meta(n, INDEX_BOUND) is not None}


@pytest.mark.parametrize("mesh", [{"pp": 2}, {"tp": 2}])
def test_the_token_input_carries_its_bound_onto_the_stage_that_reads_it(mesh):
    """gpt_tiny: idx indexes the 128-row embedding (vocab-parallel at tp=2: the bound stays the global one);
    the positions come from arange(seq), a constant checked at plan time, so no other input is bounded."""
    x = torch.randint(0, 128, (8, 16))
    result = autopar.plan(build_model("gpt_tiny"), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x)
    first = _bounds(result.graph(0, stage=0))
    assert list(first) == ["idx"] and first["idx"].rows == 128
    assert first["idx"].lookups[0].startswith("tok_emb (embedding")
    if "pp" in mesh:  # the last stage does not read the token ids
        assert _bounds(result.graph(1, stage=1)) == {}




def test_out_of_range_token_id_is_an_index_range_error_and_the_step_is_not_taken(one_rank_mesh):
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    program = autopar.compile(build_model("gpt_tiny"), one_rank_mesh, example_inputs=(x,), loss_fn=lm_loss,
                              example_target=x, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    before = program.full_state_dict()
    bad = x.clone()
    bad[2, 5] = 130
    with pytest.raises(autopar.IndexRangeError) as info:
        program.train_step(bad, target=x)
    err = info.value
    assert isinstance(err, autopar.RuntimeCommError)
    assert "training step 1: input 'idx' of microbatch 1 holds values" in err.what and "..130" in err.what
    assert "outside the table's rows 0..127 (tok_emb (embedding" in err.what
    assert err.where == "rank 0, stage 0, training step 1" and "vocabulary size" in err.fix
    assert program.step_count == 0
    assert all(torch.equal(v, program.full_state_dict()[k]) for k, v in before.items())
    assert bad[2, 5] == 130  # the caller's batch is left as it was
    negative = x.clone()
    negative[0, 0] = -1
    with pytest.raises(autopar.IndexRangeError, match=r"holds values -1\.\."):
        program(negative)
    program.train_step(x, target=x)  # a good batch still trains
    assert program.step_count == 1


@pytest.mark.dist
@pytest.mark.slow  # tests/shared_groups.py's 4-rank group
def test_out_of_range_token_id_on_one_rank_stops_every_rank_of_a_pp2_tp2_run():
    """Rank 1 (pp 0, tp 1) alone sees a token id of 133: all four ranks raise the same IndexRangeError naming
    rank 1, stage 0 and the bound (an IndexRangeError, not a RuntimeCommError: no rank waited out its
    p2p deadline); no rank stepped, and the next good step trains on every rank."""
    result = groups.result(groups.INDEX_RANGE)
    assert "error" not in result, result.get("traceback", result.get("error"))
    messages = result["messages"]
    assert len(messages) == 4 and len(set(messages)) == 1, messages
    text = messages[0]
    assert text.startswith("IndexRangeError: an index out of range at training step 2: input 'idx'"), text
    assert "..133, outside the table's rows 0..127" in text and "Where: rank 1, stage 0, training step 2" in text
    assert result["unchanged"] == [True] * 4 and result["step_counts"] == [1] * 4
    assert len(set(result["losses"])) == 1


class PositionsAsInput(torch.nn.Module):
    """Position ids passed in (as Hugging Face models take them), indexing an 8-row table."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(32, 16)
        self.pos = torch.nn.Embedding(8, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids, positions):
        return self.head(self.tok(ids) + self.pos(positions.view(positions.shape)))


def test_position_ids_given_as_an_input_are_bounded_by_the_position_table():
    ids = torch.randint(0, 32, (4, 8))
    positions = torch.arange(8).expand(4, 8).clone()
    result = autopar.plan(PositionsAsInput(), {"dp": 1}, example_inputs=(ids, positions), loss_fn=lm_loss,
                          example_target=ids)
    bounds = _bounds(result.graph(0))
    assert {name: b.rows for name, b in bounds.items()} == {"ids": 32, "positions": 8}
    assert bounds["positions"].lookups == ("pos (embedding_1, 8 rows)",)  # followed through the view
    with pytest.raises(autopar.InputError, match=r"example input 'positions' holds values 2\.\.9, outside the "
                                                 r"table's rows 0\.\.7"):
        autopar.plan(PositionsAsInput(), {"dp": 1}, example_inputs=(ids, positions + 2), loss_fn=lm_loss,
                     example_target=ids)


class IndexedTable(torch.nn.Module):
    """A parameter indexed by an input tensor (advanced indexing: -1 is the last row)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8, 4))

    def forward(self, idx):
        return self.table[idx].sum(-1)


def test_indexing_a_parameter_by_an_input_is_bounded_and_negative_indices_wrap():
    idx = torch.tensor([[0, 7], [-1, -8]])
    result = autopar.plan(IndexedTable(), {"dp": 1}, example_inputs=(idx,))
    bound = _bounds(result.graph(0))["idx"]
    assert (bound.rows, bound.low) == (8, -8) and bound.lookups[0].startswith("<root> (index")
    with pytest.raises(autopar.InputError, match=r"holds values -9\.\.7, outside the table's rows -8\.\.7"):
        autopar.plan(IndexedTable(), {"dp": 1}, example_inputs=(torch.tensor([[0, 7], [-9, 1]]),))
