"""Shared test set-up: the tests folder is importable (for the equivalence harness); markers; fixtures."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA; ``timing`` tests (wall-clock assertions) and ``slow`` ones (4- and
    8-rank spawned cases, tests/case_marks.py) skip unless ``-m`` names them."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    skip_timing = None if "timing" in (config.getoption("markexpr") or "") else pytest.mark.skip(
        reason="asserts on wall-clock time: run with -m timing on a quiet machine")
    skip_slow = None if "slow" in (config.getoption("markexpr") or "") else pytest.mark.skip(
        reason="a 4- or 8-rank spawned case, or one reading a 4-rank group's checkpoints (tests/case_marks.py): "
               "run with -m slow (.ci/run does)")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_timing is not None and "timing" in item.keywords:
            item.add_marker(skip_timing)
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A gloo group of one rank in this process and its (dp, pp, tp) = (1, 1, 1) mesh; closed after the test."""
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    finally:
        dist.destroy_process_group()
