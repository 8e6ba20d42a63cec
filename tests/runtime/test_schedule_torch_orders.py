"""Interleaved 1F1B and looped BFS against torch.distributed.pipelining's own generators, over a grid.

torch computes each rank's order in ``_calculate_single_rank_operations`` from a handful of attributes
(no process group is needed to call it); its idle slots (None) are dropped. A private method of torch's:
if a torch release renames it, the test skips saying so, and the golden orders of
test_schedule_generators.py still hold the two families."""
from __future__ import annotations

import pytest

from autopar.runtime.schedules import interleaved_1f1b, looped_bfs

S = pytest.importorskip("torch.distributed.pipelining.schedules")

GRID = [(p, m, v) for p in range(1, 6) for v in (2, 3) for m in range(p, 13, p)]


def _torch_order(cls, p: int, m: int, v: int) -> list[list[str]]:
    if not hasattr(cls, "_calculate_single_rank_operations") or not hasattr(S, "_ComputationType"):
        pytest.skip(f"torch's {cls.__name__} has no _calculate_single_rank_operations in this release")
    rows = []
    for rank in range(p):
        schedule = object.__new__(cls)  # the attributes its __init__ sets from the stages and the group
        schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, v, m
        schedule.number_of_rounds = max(1, m // p)
        schedule.microbatches_per_round = m // schedule.number_of_rounds
        schedule.rank, schedule._stages = rank, [None] * v
        kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B",
                 S._ComputationType.BACKWARD_INPUT: "B"}
        rows.append([f"{a.stage_index}{kinds[a.computation_type]}{a.microbatch_index}"
                     for a in schedule._calculate_single_rank_operations(rank) if a is not None])
    return rows


@pytest.mark.parametrize(("p", "m", "v"), GRID, ids=lambda x: str(x))
def test_interleaved_1f1b_is_torchs_order(p, m, v):
    ours = [[str(a) for a in row] for row in interleaved_1f1b(num_ranks=p, num_microbatches=m, num_virtual=v).actions]
    assert ours == _torch_order(S.ScheduleInterleaved1F1B, p, m, v)


@pytest.mark.parametrize(("p", "m", "v"), GRID, ids=lambda x: str(x))
def test_looped_bfs_is_torchs_order(p, m, v):
    ours = [[str(a) for a in row] for row in looped_bfs(num_ranks=p, num_microbatches=m, num_virtual=v).actions]
    assert ours == _torch_order(S.ScheduleLoopedBFS, p, m, v)


def test_interleaved_1f1b_needs_two_stages_per_rank_called_directly():
    """The generator checks ``num_virtual`` itself, not only through build_schedule's registry."""
    from autopar.errors import ScheduleError
    with pytest.raises(ScheduleError, match="num_virtual must be an int >= 2, got 1"):
        interleaved_1f1b(num_ranks=2, num_microbatches=2, num_virtual=1)
