"""ParallelDims: every degree in one object, its coordinates and groups against a layout of its own.

The oracle is torch's own reshape of ``arange(world)``: the mesh (dp, cp, pp, tp) row-major, as
``init_device_mesh`` lays it out, with dp unflattened into (edp, ep) as ``DeviceMesh._unflatten`` does, and
dp x cp flattened into dcp and edp x cp into edcp as ``DeviceMesh._flatten`` does.
It shares no code with ParallelDims. The groups built from a live DeviceMesh are checked in the MoE
process group (tests/runtime/test_moe_expert_parallel_dist.py).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from autopar.errors import PlanError
from autopar.parallel_dims import AXES, MESH_AXES, ParallelDims
from autopar.plan_model import MeshShape, Plan


@st.composite
def dims(draw):
    ep = draw(st.integers(1, 4))
    return ParallelDims(dp=ep * draw(st.integers(1, 3)), pp=draw(st.integers(1, 3)), tp=draw(st.integers(1, 3)),
                        ep=ep, cp=draw(st.integers(1, 3)))


def _grid(d: ParallelDims) -> torch.Tensor:
    """Global ranks laid out as (edp, ep, cp, pp, tp): the mesh's dp dim unflattened."""
    return torch.arange(d.dp * d.cp * d.pp * d.tp).reshape(d.dp // d.ep, d.ep, d.cp, d.pp, d.tp)


def _oracle(d: ParallelDims, rank: int) -> dict[str, tuple[int, list[int]]]:
    """{axis: (this rank's position, the ranks of its group)} read off the grid."""
    grid = _grid(d)
    e, k, c, p, t = (int(i) for i in (grid == rank).nonzero()[0])
    flat = grid.reshape(d.dp, d.cp, d.pp, d.tp)
    i = e * d.ep + k
    return {"dp": (i, flat[:, c, p, t].tolist()), "cp": (c, flat[i, :, p, t].tolist()),
            "pp": (p, flat[i, c, :, t].tolist()), "tp": (t, flat[i, c, p, :].tolist()),
            "ep": (k, grid[e, :, c, p, t].tolist()), "edp": (e, grid[:, k, c, p, t].tolist()),
            "dcp": (i * d.cp + c, flat[:, :, p, t].reshape(-1).tolist()),
            "edcp": (e * d.cp + c, grid[:, k, :, p, t].reshape(-1).tolist())}


@settings(max_examples=60, deadline=None)
@given(dims())
def test_coordinates_positions_and_groups_match_the_unflattened_mesh(d):
    assert d.world_size == d.dp * d.cp * d.pp * d.tp and d.edp * d.ep == d.dp and d.dcp == d.dp * d.cp
    for rank in range(d.world_size):
        coords, oracle = d.coords(rank), _oracle(d, rank)
        assert d.rank(**coords) == rank
        assert coords == {axis: oracle[axis][0] for axis in MESH_AXES if axis != "cp" or d.cp > 1}
        for axis in AXES:
            position, group = oracle[axis]
            assert d.index(axis, coords) == position, axis
            assert d.axis_ranks(axis, rank) == group, axis
            assert d.size(axis) == len(group)
    for axis in AXES:
        groups = d.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(d.world_size))  # a partition of the world
        assert all(d.axis_ranks(axis, g[0]) == g for g in groups)


def test_expert_groups_are_contiguous_dp_blocks():
    """dp index d is ep rank d % ep of block d // ep (as runtime/state/moe_groups.py laid them out before)."""
    d = ParallelDims(dp=4, ep=2)
    assert d.groups("ep") == [[0, 1], [2, 3]] and d.groups("edp") == [[0, 2], [1, 3]]
    wide = ParallelDims(dp=4, pp=1, tp=2, ep=2)  # tp inside: dp neighbours are two ranks apart
    assert wide.axis_ranks("ep", 3) == [1, 3] and wide.axis_ranks("edp", 3) == [3, 7]


@pytest.mark.parametrize("degrees,what,fix", [
    (dict(dp=4, ep=3), "expert_parallel=3 does not divide dp=4", "use an expert_parallel that divides 4"),
    (dict(dp=0), "dp=0 is not a positive int", "set dp to a whole number of ranks"),
    (dict(tp=2.0), "tp=2.0 is not a positive int", "set tp to a whole number of ranks"),
    (dict(ep=True), "expert_parallel=True is not a positive int", "set expert_parallel"),
])
def test_degrees_that_cannot_form_a_job_are_plan_errors(degrees, what, fix):
    assert ParallelDims.problem(**degrees)[0] == what
    with pytest.raises(PlanError) as info:
        ParallelDims(**degrees)
    assert info.value.what == what and info.value.fix.startswith(fix) and "the mesh" in info.value.where


def test_a_rank_outside_the_mesh_is_named():
    with pytest.raises(PlanError, match="rank 8 is outside the mesh dp=2 x pp=2 x tp=2"):
        ParallelDims(dp=2, pp=2, tp=2).coords(8)


def test_the_plan_and_the_mesh_shape_carry_their_dims():
    plan = Plan(mesh=MeshShape(dp=4, tp=2), global_batch_size=8, expert_parallel=2)
    assert plan.dims == ParallelDims(dp=4, tp=2, ep=2) and plan.dims.edp == 2
    assert MeshShape(dp=2, pp=3).dims == ParallelDims(dp=2, pp=3)
    with pytest.raises(PlanError, match="expert_parallel=3 does not divide dp=4"):
        Plan(mesh=MeshShape(dp=4), global_batch_size=8, expert_parallel=3)
