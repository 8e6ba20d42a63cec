"""Bad checkpoints: each is a CheckpointError saying what, where and what to do, and nothing is lost.

A one-rank gloo group in this process (a FileStore, no network) is enough to compile, save and
load; the many-rank cases (resharding, a crash while saving on one rank) are in
tests/runtime/test_checkpoint.py.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss




def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def _program(mesh, name="gpt_tiny", **overrides):
    torch.manual_seed(0)
    x, y = _batch()
    return autopar.compile(build_model(name, **overrides), mesh, example_inputs=(x,), loss_fn=lm_loss,
                           example_target=y, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))


def _trained_checkpoint(mesh, root):
    program = _program(mesh)
    x, y = _batch()
    program.train_step(x, target=y)
    return program, program.save_checkpoint(str(root))


def _check(info, *, what: str, where: str, fix: str):
    err = info.value
    assert type(err) is autopar.CheckpointError
    assert what in err.what, err.what
    assert where in (err.where or ""), err.where
    assert fix in (err.fix or ""), err.fix


def _unchanged(program, before: dict) -> bool:
    after = program.full_state_dict()
    return all(torch.equal(v, after[k]) for k, v in before.items()) and program.step_count == 0


def test_checkpoint_of_another_model_names_the_keys(one_rank_mesh, tmp_path):
    _trained_checkpoint(one_rank_mesh, tmp_path / "ck")
    other = _program(one_rank_mesh, "llama_tiny")
    before = other.full_state_dict()
    with pytest.raises(autopar.CheckpointError) as info:
        other.load_checkpoint(str(tmp_path / "ck"))
    _check(info, what="does not fit this model (Llama)", where="load_checkpoint", fix="same model")
    assert "missing keys ['embed_tokens.weight'" in info.value.what
    assert "unexpected keys ['blocks.0.attn.proj.bias'" in info.value.what
    assert _unchanged(other, before)


def test_checkpoint_of_another_size_names_the_shapes(one_rank_mesh, tmp_path):
    _trained_checkpoint(one_rank_mesh, tmp_path / "ck")
    wider = _program(one_rank_mesh, hidden=64)
    before = wider.full_state_dict()
    with pytest.raises(autopar.CheckpointError) as info:
        wider.load_checkpoint(str(tmp_path / "ck"))
    _check(info, what="shape mismatches", where="load_checkpoint", fix="configuration")
    assert "blocks.0.attn.proj.weight: checkpoint (32, 32) vs model (64, 64)" in info.value.what
    assert _unchanged(wider, before)


def _flip_middle_of_largest_piece(folder):
    import torch.distributed.checkpoint as dcp
    info = max(dcp.FileSystemReader(folder).read_metadata().storage_data.values(), key=lambda i: i.length)
    with open(os.path.join(folder, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = f.read(4)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize("damage,what", [
    ("flip", "checksum mismatch"),
    ("truncate_data", "is truncated"),
    ("truncate_index", "index is corrupted"),
    ("garble_manifest", "is corrupted"),
    ("drop_manifest", "is missing"),
])
def test_corrupted_checkpoint_is_a_checkpoint_error(one_rank_mesh, tmp_path, damage, what):
    program, folder = _trained_checkpoint(one_rank_mesh, tmp_path / "ck")
    if damage == "flip":
        _flip_middle_of_largest_piece(folder)
    elif damage == "truncate_data":
        _truncate(os.path.join(folder, "__0_0.distcp"), 100)
    elif damage == "truncate_index":
        _truncate(os.path.join(folder, ".metadata"), 40)
    elif damage == "garble_manifest":
        with open(os.path.join(folder, "autopar.json"), "w") as f:
            f.write("{not json")
    else:
        os.remove(os.path.join(folder, "autopar.json"))
    fresh = _program(one_rank_mesh)
    before = fresh.full_state_dict()
    with pytest.raises(autopar.CheckpointError) as info:
        fresh.load_checkpoint(folder)
    _check(info, what=what, where=str(tmp_path / "ck"), fix="earlier checkpoint")
    assert _unchanged(fresh, before)


def test_missing_checkpoint_is_a_checkpoint_error(one_rank_mesh, tmp_path):
    program = _program(one_rank_mesh)
    with pytest.raises(autopar.CheckpointError) as info:
        program.load_checkpoint(str(tmp_path / "nowhere"))
    _check(info, what="does not exist", where="load_checkpoint", fix="root folder")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(autopar.CheckpointError, match="holds no checkpoint"):
        program.load_checkpoint(str(tmp_path / "empty"))


def test_state_dict_of_another_model_is_a_checkpoint_error(one_rank_mesh):
    program = _program(one_rank_mesh)
    before = program.full_state_dict()
    other = build_model("gpt_tiny", hidden=64).state_dict()
    with pytest.raises(autopar.CheckpointError) as info:
        program.load_full_state_dict(other)
    _check(info, what="shape mismatches", where="load_full_state_dict", fix="same model")
    partial = {k: v for k, v in before.items() if k != "ln_f.weight"}
    with pytest.raises(autopar.CheckpointError, match=r"missing keys \['ln_f.weight'\]"):
        program.load_full_state_dict(partial)
    assert _unchanged(program, before)


def test_a_saved_checkpoint_loads_and_the_manifest_reads(one_rank_mesh, tmp_path):
    """The good path of the same set-up, so the failures above are about the damage alone."""
    program, folder = _trained_checkpoint(one_rank_mesh, tmp_path / "ck")
    manifest = json.loads(open(os.path.join(folder, "autopar.json")).read())
    assert manifest["step"] == 1 and manifest["model"] == "GPT"
    assert "optim/blocks.0.attn.qkv.weight/momentum_buffer" in manifest["tensors"]
    fresh = _program(one_rank_mesh)
    assert fresh.load_checkpoint(str(tmp_path / "ck")) == 1
    saved, loaded = program.full_state_dict(), fresh.full_state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    shutil.rmtree(folder)
