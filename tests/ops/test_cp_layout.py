"""The cp layout and its batch helpers (ops/context_parallel/layout.py), in one process."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.ops.context_parallel.layout import CpLayout, document_ids, join_batch, shard_batch


def test_load_balanced_ranks_hold_chunk_i_and_its_mirror():
    layout = CpLayout(seq_len=16, cp=4)
    assert [layout.chunks_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert layout.positions(1).tolist() == [2, 3, 12, 13]
    assert CpLayout(seq_len=16, cp=4, load_balanced=False).positions(1).tolist() == [4, 5, 6, 7]


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 4), chunk=st.integers(1, 3), balanced=st.booleans(), dim=st.integers(0, 2))
def test_shard_then_join_is_the_identity_and_positions_say_where_each_token_was(cp, chunk, balanced, dim):
    seq = chunk * cp * (2 if balanced else 1)
    layout = CpLayout(seq_len=seq, cp=cp, load_balanced=balanced)
    shape = [2, 3, 2]
    shape[dim] = seq
    x = torch.randn(shape)
    pieces = [layout.shard(x, dim=dim, rank=r) for r in range(cp)]
    assert torch.equal(layout.join(pieces, dim=dim), x)
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, x.index_select(dim, layout.positions(r)))
    assert sorted(layout.order().tolist()) == list(range(seq))


def test_causal_work_is_equal_on_every_rank_only_when_load_balanced():
    """Visible (query, key) pairs of each rank's queries under a causal mask, counted by brute force."""
    def work(layout):
        return [int((layout.positions(r).view(-1, 1) >= torch.arange(layout.seq_len).view(1, -1)).sum())
                for r in range(layout.cp)]
    assert len(set(work(CpLayout(seq_len=32, cp=4)))) == 1
    assert work(CpLayout(seq_len=32, cp=4, load_balanced=False)) == [36, 100, 164, 228]


def test_a_sequence_that_does_not_divide_by_2cp_is_refused_with_the_fix():
    with pytest.raises(PlanError, match=r"30 tokens does not divide by 2 x cp .* = 8.*pad every sequence"):
        CpLayout(seq_len=30, cp=4)
    CpLayout(seq_len=28, cp=4, load_balanced=False)  # contiguous: cp alone must divide
    with pytest.raises(PlanError, match="has 7 positions on dim 1"):
        CpLayout(seq_len=8, cp=2).shard(torch.zeros(2, 7), dim=1, rank=0)
    with pytest.raises(PlanError, match="cp rank 2 is outside 0..1"):
        CpLayout(seq_len=8, cp=2).positions(2)


def test_document_ids_restart_with_the_positions_of_each_row():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]


def test_shard_batch_adds_global_positions_and_joins_back():
    layout = CpLayout(seq_len=8, cp=2)
    ids = torch.arange(16).view(2, 8)
    batch = {"input_ids": ids, "labels": ids + 100, "attention_mask": torch.ones(2, 8, dtype=torch.long),
             "count": torch.tensor(5)}
    pieces = [shard_batch(batch, layout=layout, rank=r) for r in range(2)]
    assert pieces[1]["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert pieces[0]["position_ids"].tolist() == [[0, 1, 6, 7]] * 2
    assert pieces[0]["count"] is batch["count"]
    joined = join_batch(pieces, layout=layout, keys=("input_ids", "labels", "position_ids"))
    assert torch.equal(joined["labels"], batch["labels"])
    assert joined["position_ids"].tolist() == [list(range(8))] * 2


def test_shard_batch_of_packed_rows_numbers_documents_on_the_whole_row():
    """A document crossing the shard boundary keeps one id on both ranks (ids from the whole row)."""
    layout = CpLayout(seq_len=8, cp=2)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    pieces = [shard_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": positions},
                          layout=layout, rank=r) for r in range(2)]
    assert pieces[0]["document_ids"].tolist() == [[0, 0, 1, 1]]  # positions 0, 1, 6, 7
    assert pieces[1]["document_ids"].tolist() == [[0, 1, 1, 1]]  # positions 2, 3, 4, 5
    assert pieces[1]["position_ids"].tolist() == [[2, 0, 1, 2]]
