"""A meta-built Phi-3 with grouped-query attention, round trip: pretrained folder -> tp=2 -> train -> save -> reshard.

Phi-3 fuses its attention projection, ``qkv_proj = [q | k | v]``; with 4 query heads and 2 kv heads the q
block is twice the k and v blocks, so tensor parallelism cuts it in unequal blocks (each rank its query heads
and its kv head: ``ShardLayout(blocks=...)``, ir/shard_layout.py), and ``gate_up_proj`` in 2 equal ones.
Built as a new user builds it (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``, the folder
given to ``compile(weights=...)``), each rank reads its pieces of a folder ``save_pretrained`` wrote; it trains
equal to transformers' own loop on the folder's model (the harness's equivalence: every rank, every dp replica,
relative 1e-5), writes a folder that ``from_pretrained`` loads with exactly the trained weights, and a
checkpoint that another mesh (no tensor parallelism: the blocks joined) loads and trains on from there.

At tp=2 alone (2 ranks, resharded to dp=2) in the default suite; at pp=2 x tp=2 and dp=2 x tp=2 (resharded
to dp=4) with the ``slow`` 4-rank groups (tests/case_marks.py).
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

from case_marks import by_world  # noqa: E402
from equivalence import Case, assert_equivalent, run_cases

pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None,
    reason="needs transformers and safetensors (the [test] extra)")]

_R = "hf_weight_runners:"
STEPS, SAVE_AFTER = 3, 2
QKV = "model.layers.0.self_attn.qkv_proj.weight"


@functools.lru_cache(maxsize=None)
def _root() -> str:
    root = tempfile.mkdtemp(prefix="autopar-phi3-")
    atexit.register(shutil.rmtree, root, True)
    return root


def _path(name: str) -> str:
    return os.path.join(_root(), name)


def _pair(save_mesh: tuple, resume_mesh: tuple, options: tuple = ()) -> tuple[Case, Case]:
    """Train and save on ``save_mesh``; load the checkpoint on ``resume_mesh`` and train the remaining steps."""
    name = "x".join(map(str, save_mesh))
    common = (("folder", _path("pretrained")), ("ckpt", _path(f"ckpt-{name}")), ("save_after", SAVE_AFTER))
    save = Case(model="phi3", mesh=save_mesh, kind=_R + "phi3_train_save", steps=STEPS, options=options,
                extra=common + (("out", _path(f"out-{name}")),))
    return save, Case(model="phi3", mesh=resume_mesh, kind=_R + "phi3_resume", steps=STEPS, extra=common)


PAIRS = [_pair((1, 1, 2), (2, 1, 1)), _pair((1, 2, 2), (4, 1, 1)), _pair((2, 1, 2), (4, 1, 1))]
SAVES = [s for s, _ in PAIRS]
RESUMES = [r for _, r in PAIRS]


def _write_pretrained() -> None:
    """The folder a user downloads: a seeded Phi-3 (library defaults, fused qkv and gate_up), save_pretrained."""
    from autopar.models.hf import build_hf_raw
    if not os.path.isdir(_path("pretrained")):
        torch.manual_seed(5)
        build_hf_raw("phi3").save_pretrained(_path("pretrained"))


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    _write_pretrained()
    cases = [c for pair in PAIRS for c in pair if c.world_size == world]  # each save before its resume
    return dict(zip(cases, run_cases(cases)))


def _result(case: Case) -> dict:
    result = _results(case.world_size)[case]
    assert "error" not in result, f"{case.name()}:\n{result.get('traceback', result['error'])}"
    return result


def _pretrained():
    import transformers
    transformers.logging.set_verbosity_error()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(_path("pretrained"), output_loading_info=True)
    assert not any(info.values()), info
    return model


@functools.lru_cache(maxsize=None)
def _reference() -> list[dict]:
    """transformers' own loop on the folder's model, one device: the losses, and the weights after each step."""
    from hf_runners import logits_loss, sgd, token_batches
    model = _pretrained()
    opt = sgd(SAVES[0])(list(model.parameters()))
    out = []
    for x, y in token_batches(SAVES[0]):
        opt.zero_grad()
        loss = logits_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append({"loss": loss.item(), "state": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    return out


def _expected(first: int, last: int) -> dict:
    steps = _reference()[first:last]
    return {"losses": [s["loss"] for s in steps], "state": steps[-1]["state"]}


@pytest.mark.parametrize("case", by_world(SAVES, ids=Case.name))
def test_meta_built_phi3_loads_trains_and_saves_a_folder_from_pretrained_reads(case):
    import transformers
    result = _result(case)
    blocks = result["shards"][QKV]["blocks"]
    assert [parts for _, parts in blocks] == [0, 0, 0] and blocks[0][0] == 2 * blocks[1][0], blocks  # q | k | v
    assert result["shards"]["model.layers.0.mlp.gate_up_proj.weight"]["chunks"] == 2
    assert result["still_meta"]  # the user's model was never materialised
    pretrained = _pretrained().state_dict()
    assert set(result["loaded"]) == set(pretrained)
    for key, value in result["loaded"].items():  # every rank read its pieces, joined they are the folder
        assert torch.equal(value, pretrained[key]), key
    assert_equivalent(case, result, _expected(0, SAVE_AFTER))
    saved, info = transformers.AutoModelForCausalLM.from_pretrained(dict(case.extra)["out"], output_loading_info=True)
    assert not any(info.values()), info
    assert type(saved).__name__ == "Phi3ForCausalLM" and set(saved.state_dict()) == set(result["state"])
    for key, value in saved.state_dict().items():
        assert torch.equal(value, result["state"][key]), key


@pytest.mark.parametrize("case", by_world(RESUMES, ids=Case.name))
def test_its_checkpoint_reshards_without_tensor_parallelism_and_trains_on(case):
    save = next(s for s, r in PAIRS if r == case)
    assert "error" not in _results(save.world_size)[save]  # (the checkpoint exists)
    result = _result(case)
    assert result["step"] == SAVE_AFTER
    assert_equivalent(case, result, _expected(SAVE_AFTER, STEPS))
