"""ShardLayout (ir/shard_layout.py): every rank's piece against an oracle written here, and the round trips.

The oracle cuts a tensor of distinct values with torch's own ``split``/``chunk``, block by block, as the
layouts are documented (rank r holds piece ``r * ways // size`` of a block cut ``ways`` ways; the inner dim's
piece ``r % (size / parts)``), sharing no code with ShardLayout's index ranges.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from autopar.errors import PlanError
from autopar.ir.shard_layout import EXPERTS, ZERO3, ShardLayout
from autopar.plan_model import Plan


def _oracle(full: torch.Tensor, layout: ShardLayout, *, rank: int, size: int) -> torch.Tensor:
    dim = layout.dim
    if layout.blocks:
        blocks = full.split([n for n, _ in layout.blocks], dim=dim)
        cuts = [p or size for _, p in layout.blocks]
    else:
        blocks = full.chunk(layout.chunks, dim=dim)
        cuts = [layout.parts or size] * layout.chunks
    out = torch.cat([b.chunk(w, dim=dim)[rank * w // size] for b, w in zip(blocks, cuts)], dim=dim)
    if layout.inner is not None:
        ways = size // layout.parts
        out = out.chunk(ways, dim=layout.inner)[rank % ways]
    return out


def _padded_oracle(full: torch.Tensor, layout: ShardLayout, *, rank: int, size: int) -> torch.Tensor:
    """A padded dim: zeros appended up to a multiple of size, then block rank of size equal blocks."""
    extent = full.shape[layout.dim]
    more = list(full.shape)
    more[layout.dim] = -extent % size
    return torch.cat([full, full.new_zeros(more)], dim=layout.dim).chunk(size, dim=layout.dim)[rank]


SIZES = (1, 2, 4, 6)


@st.composite
def layouts(draw):
    """(layout, size, full shape): a layout that cuts the shape evenly over size ranks."""
    size = draw(st.sampled_from(SIZES))
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    kind = draw(st.sampled_from(["equal", "parts", "inner", "blocks", "pad"] if ndim > 1
                                else ["equal", "parts", "blocks", "pad"]))
    if kind == "pad":  # any extent, 0 included
        shape[dim] = draw(st.integers(0, 3 * size + 1))
        return ShardLayout(dim, pad=True), size, tuple(shape)
    if kind == "blocks":
        parts = [draw(st.sampled_from([0] + divisors)) for _ in range(draw(st.integers(1, 4)))]
        blocks = tuple(((p or size) * draw(st.integers(1, 3)), p) for p in parts)  # a multiple of its ways
        layout = ShardLayout(dim, blocks=blocks)
        shape[dim] = sum(n for n, _ in blocks)
        return layout, size, tuple(shape)
    chunks = draw(st.integers(1, 3))
    parts = draw(st.sampled_from(divisors)) if kind in ("parts", "inner") else 0
    inner = None
    if kind == "inner":
        inner = draw(st.sampled_from([d for d in range(ndim) if d != dim]))
        shape[inner] *= size // parts
    shape[dim] *= chunks * (parts or size)
    return ShardLayout(dim, chunks=chunks, parts=parts, inner=inner), size, tuple(shape)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_rank_cuts_its_piece_and_the_pieces_join(case):
    layout, size, shape = case
    full = torch.arange(math.prod(shape)).reshape(shape)
    assert layout.misfit(shape, size) is None
    pieces = [layout.cut(full, rank=r, size=size) for r in range(size)]
    oracle = _padded_oracle if layout.pad else _oracle
    for rank, piece in enumerate(pieces):
        assert torch.equal(piece, oracle(full, layout, rank=rank, size=size)), (layout, size, rank)
        assert piece.is_contiguous()
        assert piece.numel() == 0 or piece.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        assert tuple(piece.shape) == layout.local_shape(shape, size)
        assert layout.local_size(shape[layout.dim], size) == piece.shape[layout.dim]
        runs = layout.ranges(shape, rank=rank, size=size)
        if layout.pad:  # the ranges leave the padding out
            assert layout.full_shape(piece.shape, size)[layout.dim] == piece.shape[layout.dim] * size
            assert sum(b - a for a, b in runs[layout.dim]) == min(piece.shape[layout.dim], max(
                0, shape[layout.dim] - rank * piece.shape[layout.dim]))
            continue
        assert layout.full_shape(piece.shape, size) == shape
        assert [sum(b - a for a, b in r) for r in runs] == list(piece.shape)
    extent = shape[layout.dim]
    if layout.pad:
        assert all(torch.equal(a, b) for a, b in zip(layout.pieces(full, size=size), pieces, strict=True))
        assert torch.equal(layout.join(pieces, size=size, extent=extent), full)
        return
    distinct = {tuple(p.reshape(-1).tolist()) for p in pieces}
    assert len(distinct) == layout.ways(size)
    for rank in range(size):  # ranks with one piece index hold one piece; the first holder is its first rank
        j = layout.piece_of(rank, size)
        assert torch.equal(pieces[rank], pieces[layout.first_rank(j, size)])
        assert layout.first_rank(j, size) <= rank
    by_piece = [pieces[layout.first_rank(j, size)] for j in range(layout.ways(size))]
    assert torch.equal(layout.join(by_piece, size=size), full)
    assert torch.equal(layout.join(pieces, size=size), full)
    assert all(torch.equal(a, b) for a, b in zip(layout.pieces(full, size=size), by_piece, strict=True))


def test_phi3_fused_qkv_with_fewer_kv_heads():
    """[q (4 heads) | k (2) | v (2)] of head size 2 over tp=2 and 4: each rank its q heads and its kv head."""
    qkv = ShardLayout(0, blocks=((8, 0), (4, 2), (4, 2)))
    full = torch.arange(16)
    assert [qkv.cut(full, rank=r, size=2).tolist() for r in range(2)] == [
        [0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 10, 11, 14, 15]]
    assert [qkv.cut(full, rank=r, size=4).tolist() for r in range(4)] == [
        [0, 1, 8, 9, 12, 13], [2, 3, 8, 9, 12, 13], [4, 5, 10, 11, 14, 15], [6, 7, 10, 11, 14, 15]]
    assert qkv.ways(4) == 4 and qkv.local_size(16, 4) == 6


def test_equal_chunks_cut_every_block():
    qkv = ShardLayout(0, chunks=3)
    assert qkv.cut(torch.arange(12), rank=1, size=2).tolist() == [2, 3, 6, 7, 10, 11]
    assert EXPERTS.cut(torch.arange(8).view(4, 2), rank=1, size=2).tolist() == [[4, 5], [6, 7]]
    assert [ZERO3.cut(torch.arange(5), rank=r, size=3).tolist() for r in range(3)] == [[0, 1], [2, 3], [4, 0]]


def test_a_layout_that_does_not_divide_says_so():
    assert ShardLayout(1).misfit((2, 6), 4, what="w") == "dim 1 of w (2, 6) has size 6, not divisible by tp=4"
    assert "x 3 blocks" in ShardLayout(0, chunks=3).misfit((9,), 2)
    assert "a block of size 3 of dim 0 of the tensor (7,)" in ShardLayout(0, blocks=((4, 0), (3, 0))).misfit((7,), 2)
    assert "dim 0 of the tensor (3, 1) has size 3, not divisible by 2" in ShardLayout(1, parts=1, inner=0).misfit((3, 1), 2)
    assert ShardLayout(0, chunks=3).misfit((12,), 2) is None
    with pytest.raises(ValueError, match="cuts across the blocks"):
        ShardLayout(0, blocks=((4, 0), (2, 1))).between(0, 5)
    assert ShardLayout(0, blocks=((4, 0), (2, 1), (2, 1))).between(4, 6) == ShardLayout(0, parts=1)


@pytest.mark.parametrize("bad", [dict(dim=-1), dict(dim=0, chunks=0), dict(dim=0, blocks=((4, 0),), chunks=2),
                                 dict(dim=0, inner=1), dict(dim=0, parts=1, inner=0), dict(dim=0, blocks=((0, 1),)),
                                 dict(dim=0, chunks=2, pad=True)])
def test_an_impossible_layout_is_refused(bad):
    with pytest.raises(ValueError):
        ShardLayout(**bad)


def test_the_plan_holds_layouts_round_trips_them_and_refuses_bad_ones():
    shards = {"qkv.weight": ShardLayout(0, blocks=((8, 0), (4, 2), (4, 2))), "up.weight": ShardLayout(0, chunks=2),
              "kv.weight": ShardLayout(0, parts=1)}
    plan = Plan(global_batch_size=4, param_shards=shards)
    text = plan.model_dump_json()
    assert Plan.model_validate_json(text) == plan and Plan.model_validate(plan.model_dump()) == plan
    assert json.loads(text)["param_shards"]["qkv.weight"] == {"dim": 0, "chunks": 1, "parts": 0,
                                                              "blocks": [[8, 0], [4, 2], [4, 2]]}
    with pytest.raises(PlanError, match="param_shards.up.weight"):
        Plan(global_batch_size=4, param_shards={"up.weight": {"dim": 0, "chunks": 0}})
    with pytest.raises(PlanError, match="param_shards.up.weight"):
        Plan(global_batch_size=4, param_shards={"up.weight": {"dim": 0, "rows": 2}})
