"""Checkpoints: pieces and layouts, atomic publish, and (spawned) save on one mesh, load on another.

The spawned cases live in tests/shared_groups.py (one group per world size, shared with the fault
and real-world-model tests).
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from autopar.errors import CheckpointError
from autopar.ir.shard_layout import ShardLayout
from autopar.runtime.checkpoints import checkpoint_files as files
from autopar.runtime.checkpoints.checkpoint_layout import Layout, join, split
from equivalence import Case, assert_equivalent, build, reference_run

import shared_groups as groups
from ckpt_runners import reference_from


# -- plain: layouts and files ------------------------------------------------------------------------
def _tp(dim: int, chunks: int, size: int) -> dict:
    """A Layout's tensor-parallel cut: ``chunks`` equal blocks of ``dim``, each over ``size`` ranks."""
    return {"tp": ShardLayout(dim, chunks=chunks), "tp_size": size}


@pytest.mark.parametrize("layout", [
    Layout((6, 4)), Layout((6, 4), **_tp(0, 1, 2)), Layout((6, 4), **_tp(1, 1, 2)), Layout((6, 4), **_tp(0, 3, 2)),
    Layout((6, 4), z3=4), Layout((6, 4), **_tp(0, 3, 2), z3=5), Layout((5,), z3=2),
    # a fused [q | k | v] with fewer kv heads (unequal blocks), kv heads held whole or cut 2 of 4 ways
    Layout((8, 3), tp=ShardLayout(0, blocks=((4, 0), (2, 1), (2, 1))), tp_size=2), Layout((8, 3), tp=ShardLayout(0, blocks=((4, 0), (2, 1), (2, 1))), tp_size=2, z3=3),
    Layout((8, 3), tp=ShardLayout(0, blocks=((4, 0), (2, 2), (2, 2))), tp_size=4),
    Layout((4, 3), tp=ShardLayout(1, parts=1), tp_size=2), Layout((4, 6), tp=ShardLayout(0, chunks=2, parts=2), tp_size=4),
], ids=str)
def test_pieces_join_to_the_logical_tensor(layout):
    full = torch.randn(layout.shape)
    pieces = {k: split(full, layout, tp_index=t, z_index=z) for k, t, z in layout.pieces("w")}
    assert all(p.shape == layout.piece_shape() for p in pieces.values())
    assert torch.equal(join(pieces, layout, "w"), full)


@pytest.mark.parametrize("layout", [
    Layout((4, 6), ep=2), Layout((4, 8, 4), **_tp(1, 2, 2), ep=2), Layout((4, 6, 4), **_tp(2, 1, 2), ep=4),
], ids=str)
def test_expert_pieces_join_to_the_logical_tensor(layout):
    full = torch.randn(layout.shape)
    pieces = {k: split(full, layout, tp_index=t, z_index=z, ep_index=e) for k, e, t, z in layout.expert_pieces("w")}
    assert len(pieces) == layout.ep * layout.tp_ways
    assert all(p.shape == layout.piece_shape() for p in pieces.values())
    assert torch.equal(join(pieces, layout, "w"), full)
    assert torch.equal(pieces[layout.key("w", ep_index=1, tp_index=0, z_index=0)],
                       split(full[layout.shape[0] // layout.ep:2 * layout.shape[0] // layout.ep],
                             Layout(layout.ep_local_shape(), tp=layout.tp, tp_size=layout.tp_size), tp_index=0, z_index=0))
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


def test_layout_round_trips_through_json():
    for layout in (Layout((6, 4), **_tp(0, 3, 2), z3=2), Layout((8, 3), tp=ShardLayout(0, blocks=((4, 0), (2, 1), (2, 1))), tp_size=2, z3=3)):
        assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


def test_a_layout_written_before_shard_layout_reads_as_the_same_cut():
    """A manifest of an older checkpoint holds ``tp`` as [dim, chunks, pieces]: the same pieces."""
    old = Layout.from_json({"shape": [6, 4], "tp": [0, 3, 2], "z3": None})
    assert old == Layout((6, 4), **_tp(0, 3, 2))


def test_publish_moves_latest_only_when_complete(tmp_path):
    root = str(tmp_path)
    for step in (1, 2):
        tmp = files.tmp_dir_for(root, step)
        os.makedirs(tmp)
        files.write_manifest(tmp, {"format": files.FORMAT, "step": step})
        assert files.latest_step_dir(root) == (None if step == 1 else os.path.join(root, "step_00000001"))
        files.publish(tmp, root, step)
    assert files.resolve(root) == os.path.join(root, "step_00000002")
    os.makedirs(files.tmp_dir_for(root, 3))  # a save that died before publishing
    assert files.resolve(root) == os.path.join(root, "step_00000002")
    assert files.read_manifest(files.resolve(root))["step"] == 2


def test_missing_and_garbled_checkpoints_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        files.resolve(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        files.resolve(str(tmp_path))
    (tmp_path / files.MANIFEST).write_text("{broken")
    with pytest.raises(CheckpointError, match="corrupted"):
        files.read_manifest(str(tmp_path))
    (tmp_path / files.MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="not an autopar checkpoint"):
        files.read_manifest(str(tmp_path))


# -- spawned: save on one mesh, load on another ------------------------------------------------------
def _result(case):
    result = groups.result(case)
    assert "error" not in result, f"{case.name()}:\n{result.get('traceback', result['error'])}"
    return result


def _reference(case) -> dict:
    return reference_run(Case(model=case.model, overrides=case.overrides, steps=case.steps,
                              optimizer=case.optimizer, lr=case.lr))


@pytest.mark.dist
@pytest.mark.parametrize("case", groups.params(groups.RESUME_T + groups.RESUME_A + groups.RESUME_Z))
def test_resumed_on_another_mesh_trains_like_one_device(case):
    """Saved after 2 steps at (dp, pp, tp) = (1, 1, 2) or (1, 2, 2) (or under ZeRO-3 at (2, 1, 2)), loaded
    into a model with other weights on another mesh: the 4 steps equal one device's."""
    save = {"T": groups.SAVE_T, "A": groups.SAVE_A, "Z": groups.SAVE_Z}[dict(case.extra)["name"]]
    saved, resumed = _result(save), _result(case)
    assert saved["step"] == resumed["step"] == 2
    combined = {"losses": saved["losses"] + resumed["losses"], "state": resumed["state"]}
    assert_equivalent(case, combined, _reference(case))


@pytest.mark.dist
@pytest.mark.parametrize("case", groups.params(groups.RESUME_CP + groups.RESUME_CP_ONE + groups.RESUME_CP_FOUR))
def test_resumed_across_context_parallelism_trains_like_one_device(case):
    """Saved after 2 steps at cp=2 (ZeRO-1, ZeRO-3: shards over dp x cp) or at dp=2 (ZeRO-3), loaded into a
    model with other weights at dp=2, at cp=2 under the other ZeRO stage, or on one rank; saved at cp=2 x tp=2
    under ZeRO-3, loaded at dp=2 x tp=2, pp=2 x cp=2 and tp=2 (slow): the 4 steps equal one device's (losses
    and every parameter; the harness judges every rank and replica)."""
    name = dict(case.extra)["name"]
    saver = next(c for c in groups.SAVE_CP + [groups.SAVE_CP_FOUR] if dict(c.extra)["name"] == name)
    saved, resumed = _result(saver), _result(case)
    assert saved["step"] == resumed["step"] == 2
    combined = {"losses": saved["losses"] + resumed["losses"], "state": resumed["state"]}
    assert_equivalent(case, combined, _reference(case))


@pytest.mark.dist
def test_adamw_state_and_step_resume_exactly():
    """AdamW's step counter and moments come back: equal to the same mesh's run without a stop."""
    full, saved, resumed = (_result(c) for c in (groups.ADAM_FULL, groups.SAVE_ADAM, groups.RESUME_ADAM))
    combined = {"losses": saved["losses"] + resumed["losses"], "state": resumed["state"]}
    assert_equivalent(groups.RESUME_ADAM, combined, full)


@pytest.mark.dist
def test_crash_while_saving_keeps_the_previous_checkpoint():
    out = _result(groups.CRASH)
    assert "saving step 2 failed" in out["message"] and "simulated crash" in out["message"]
    assert out["latest"] == "step_00000001" and out["step"] == 1 and out["same"]
    assert out["leftovers"] == []


@pytest.mark.dist
def test_bad_checkpoints_raise_and_lose_nothing():
    out = _result(groups.BAD)
    assert "does not fit this model" in out["other_model"]
    assert "missing keys" in out["other_model"] and "unexpected keys" in out["other_model"]
    assert "blocks.0.attn.qkv.weight" in out["other_model"]  # a key only the checkpoint's model has
    assert "checksum mismatch" in out["flipped"]
    assert "index is corrupted" in out["index"]
    assert "manifest" in out["manifest"] and "corrupted" in out["manifest"]
    assert "does not exist" in out["missing"]
    assert "missing keys ['blocks.0.mlp.fc.weight']" in out["state_dict"]
    assert out["unchanged"] and out["other_unchanged"]


@pytest.mark.dist
def test_full_state_dict_exports_and_starts_training():
    """The exported state_dict loads into the plain model (the runner checks strict loading), holds
    what one device holds after the same steps, and a program started from it trains like one device
    that stops there and restarts its optimizer (the oracle never reads what the program exported)."""
    case = groups.ROUNDTRIP
    out = _result(case)
    k = dict(case.extra)["save_after"]
    one_device = reference_run(dataclasses.replace(case, kind="train", extra=(), steps=k))  # the first k batches
    assert_equivalent(case, {"losses": out["first"], "state": out["exported"]}, one_device)
    expected = reference_from(case, one_device["state"], k)
    assert_equivalent(case, {"losses": out["losses"], "state": out["state"]}, expected)


@pytest.mark.dist
def test_tensors_no_graph_reads_go_out_and_in_with_the_weights():
    """A module and a buffer the forward never reads: in full_state_dict untrained (as on one device),
    set by load_full_state_dict, saved at pp=2 and loaded at tp=2; a meta build fills them by init replay."""
    from ckpt_runners import SPARE_KEYS, _with_spare
    saved, resumed = _result(groups.UNUSED_SAVE), _result(groups.UNUSED_RESUME)
    assert saved["keys"] == saved["model_keys"]  # nothing lost
    expected = {"spare.weight": torch.full((3, 4), 0.5), "spare.bias": torch.arange(3.0),
                "spare_count": torch.tensor([7.0, 11.0])}
    cpu = _with_spare(build(groups.UNUSED_SAVE))
    torch.manual_seed(1234)  # the meta build's seed: the replay runs the root's reset_parameters, spare included
    cpu.reset_parameters()
    for what, got, want in [("exported after 2 steps", saved["exported"], saved["original"]),
                            ("after load_full_state_dict", saved["loaded"], expected),
                            ("loaded from the checkpoint on another mesh", resumed["resumed"], expected),
                            ("meta-built", saved["meta_spare"], {k: cpu.state_dict()[k] for k in SPARE_KEYS[:2]})]:
        assert set(got) == set(want), what
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=lambda m, k=key: f"{what} {k}: {m}")


def _same(a: dict, b: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    assert set(a["state"]) == set(b["state"])
    for key in a["state"]:
        torch.testing.assert_close(b["state"][key], a["state"][key], rtol=1e-5, atol=0,
                                   msg=lambda m, k=key: f"{what} parameter {k}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("case", groups.params(groups.DROPOUT_RESUME))
def test_random_state_resumes_exactly_on_the_same_mesh(case):
    """Dropout at pp=2 x tp=2 and at tp=2 (default and tp streams): run A trains 2 steps, saves, trains 2
    more; run B loads the checkpoint into a fresh program with another random state and trains the same 2
    steps: the same losses and weights. Without the default stream restored the first loss differs."""
    out = _result(case)
    assert out["step"] == 2 and len(out["a"]["losses"]) == 2
    _same(out["a"], out["b"], "resumed with dropout")
    assert abs(out["unrestored_loss"] - out["a"]["losses"][0]) > 1e-4 * abs(out["a"]["losses"][0])


@pytest.mark.dist
@pytest.mark.parametrize("case", groups.params(groups.DROPOUT_RESHARD))
def test_random_state_on_another_mesh_is_rederived_deterministically(case):
    """The dropout checkpoints loaded on another mesh (pp=2 x tp=2 at dp=2 x tp=2, tp=2 at dp=2): every
    rank and tp stream re-seeded from the saved seed and step, logged, and the same losses on every load."""
    out = _result(case)
    saver = next(c for c in groups.DROPOUT_RESUME if c.extra[0] == case.extra[0])
    assert out["reseeded"] == [True] * case.world_size
    assert out["runs"][0] == out["runs"][1]
    assert len(out["log"]) == 2 and "cannot map 1:1" in out["log"][0] and str(saver.mesh) in out["log"][0]


def test_random_state_maps_one_to_one_only_on_the_same_cp_degree():
    """The rng manifest records cp: a checkpoint of dp=1 x cp=2 restores 1:1 at cp=2 only; one saved before
    cp existed (no ``cp``) counts as cp=1."""
    from types import SimpleNamespace

    from autopar.plan_model import MeshShape
    from autopar.runtime.checkpoints import rng_state

    def program(**mesh):
        return SimpleNamespace(plan=SimpleNamespace(mesh=MeshShape(**mesh)))
    saved = rng_state.rng_manifest(program(cp=2), 2)
    assert saved["mesh"] == [1, 1, 1] and saved["cp"] == 2
    assert rng_state.same_layout(saved, program(cp=2), 2)
    assert not rng_state.same_layout(saved, program(dp=2), 2) and not rng_state.same_layout(saved, program(tp=2), 2)
    older = {k: v for k, v in saved.items() if k != "cp"}  # the same (dp, pp, tp) and world, cp not recorded
    assert not rng_state.same_layout(older, program(cp=2), 2)
    assert rng_state.same_layout(rng_state.rng_manifest(program(dp=2), 2), program(dp=2), 2)
