"""A one-rank group and its (dp, pp, tp) = (1, 1, 1) mesh on a device: NCCL on ``cuda:0``, gloo on CPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture
def mesh_on(tmp_path):
    """``mesh_on("cuda")`` (TF32 off, so fp32 matmuls are fp32) or ``mesh_on("cpu")``; closed after the test."""
    opened = []

    def make(device: str):
        if device == "cuda":
            torch.cuda.set_device(0)
            opened.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
        return init_device_mesh(device, (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()
    for tf32 in opened:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
