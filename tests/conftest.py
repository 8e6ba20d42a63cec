"""Shared test set-up: the tests folder is importable (for the equivalence harness)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA; ``timing`` tests (wall-clock assertions) skip unless ``-m`` names them."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    skip_timing = None if "timing" in (config.getoption("markexpr") or "") else pytest.mark.skip(
        reason="asserts on wall-clock time: run with -m timing on a quiet machine")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_timing is not None and "timing" in item.keywords:
            item.add_marker(skip_timing)
