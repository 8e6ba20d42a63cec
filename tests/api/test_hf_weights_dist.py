"""Hugging Face checkpoints in and out on a spawned group of 4 ranks (autopar.hf).

- pretrained folder -> autopar at pp=2 x tp=2 -> logits equal to transformers' eager model on the
  same weights, each rank reading only its pieces (Llama from a sharded index, GPT-2 from one file),
  into a compiled program or, for a model built on the meta device, as compile's ``weights=`` filler;
- load, train, save -> ``AutoModelForCausalLM.from_pretrained`` -> the trained weights exactly, and
  logits equal to the autopar program's; the training itself equal to one device from the same
  weights (the equivalence harness's tolerances), at pp=2 x tp=2 and at dp=2 x tp=2 under ZeRO-3;
- under bf16 with ZeRO-2 the fp32 masters get the folder's values and every bf16 copy their rounding;
- autopar's own GPT (a fused qkv: three blocks, each sharded) at pp=2 x tp=2 and under ZeRO-3.

One group runs every case (start-up costs seconds); the folders are written here before it starts.
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
from equivalence import RTOL, Case, assert_equivalent, batches, build, make_optimizer, run_cases

pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None,
    reason="needs transformers and safetensors (the [test] extra)")]

_R = "hf_weight_runners:"


@functools.lru_cache(maxsize=None)
def _root() -> str:
    root = tempfile.mkdtemp(prefix="autopar-hf-")
    atexit.register(shutil.rmtree, root, True)
    return root


def _folder(name: str) -> str:
    return os.path.join(_root(), name)


def _cases() -> list[Case]:
    llama_in = (("folder", _folder("llama")),)
    gpt2_in = (("folder", _folder("gpt2")),)
    gpt_in = (("folder", _folder("gpt")),)
    return [
        Case(model="hf_llama", mesh=(1, 2, 2), kind=_R + "pretrained_logits", steps=2, extra=llama_in),
        Case(model="hf_gpt2", mesh=(1, 2, 2), kind=_R + "pretrained_logits", steps=2, extra=gpt2_in),
        # built on the meta device: the folder is compile's weights= filler, nothing else is allocated
        Case(model="hf_llama", mesh=(1, 2, 2), kind=_R + "pretrained_logits", steps=2,
             extra=llama_in + (("meta", True),)),
        Case(model="hf_llama", mesh=(1, 2, 2), kind=_R + "train_save", steps=2,
             extra=llama_in + (("out", _folder("llama_out")), ("shard", "20KB"))),
        Case(model="hf_gpt2", mesh=(1, 2, 2), kind=_R + "train_save", steps=2,
             extra=gpt2_in + (("out", _folder("gpt2_out")),)),
        Case(model="hf_llama", mesh=(2, 1, 2), kind=_R + "train_save", steps=2, options=(("zero_stage", 3),),
             extra=llama_in + (("out", _folder("llama_z3_out")),)),
        Case(model="hf_llama", mesh=(2, 1, 2), kind=_R + "loaded", extra=llama_in,
             options=(("precision", "bf16"), ("zero_stage", 2))),
        # autopar's own GPT: a fused qkv (3 blocks, each sharded) read as 3 ranges, also as ZeRO-3 rows
        Case(model="gpt_tiny", mesh=(1, 2, 2), kind=_R + "pretrained_logits", steps=2, extra=gpt_in),
        Case(model="gpt_tiny", mesh=(2, 1, 2), kind=_R + "loaded", extra=gpt_in, options=(("zero_stage", 3),)),
    ]


CASES = _cases()


def _library_model(case: Case, folder: str | None = None):
    """transformers' own class of the case's family: with the folder's weights, or fresh ones (seeded)."""
    import transformers
    transformers.logging.set_verbosity_error()
    wrapped = build(case)  # autopar.models.hf's logits-only subclass; its parent is the library class
    library = type(wrapped).__mro__[1]
    if folder is not None:
        model, info = library.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), f"{folder}: from_pretrained reported {info}"
        return model.eval()
    torch.manual_seed(5)  # other weights than equivalence.build's: a tensor the load missed shows
    return library(wrapped.config).eval()


def _own_gpt() -> dict:
    """autopar's GPT (fused qkv) with other weights than equivalence.build's, tied head cloned."""
    model = build(Case(model="gpt_tiny"))
    g = torch.Generator().manual_seed(5)
    return {k: (v + 0.02 * torch.randn(v.shape, generator=g)).contiguous() for k, v in model.state_dict().items()}


def _write_pretrained() -> None:
    from safetensors.torch import save_file
    _library_model(Case(model="hf_llama")).save_pretrained(_folder("llama"), max_shard_size="30KB")
    _library_model(Case(model="hf_gpt2")).save_pretrained(_folder("gpt2"))
    os.makedirs(_folder("gpt"))
    state = _own_gpt()
    state["lm_head.weight"] = state["tok_emb.weight"].clone()  # tied in the model: one value under both names
    save_file(state, os.path.join(_folder("gpt"), "model.safetensors"))


def _folder_state(case: Case) -> dict:
    """The folder's weights under the model's names (every key, tied ones too)."""
    if case.model == "gpt_tiny":
        state = _own_gpt()
        state["lm_head.weight"] = state["tok_emb.weight"]
        return state
    return _library_model(case, dict(case.extra)["folder"]).state_dict()


def _cases_of(kind: str) -> list:
    """The cases whose runner ends in ``kind``, as params (4 ranks: the ``slow`` set, tests/case_marks.py)."""
    return by_world([c for c in CASES if c.kind.endswith(kind)], ids=Case.name)


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    _write_pretrained()
    return dict(zip(CASES, run_cases(CASES)))


def _result(case: Case) -> dict:
    result = _results()[case]
    assert "error" not in result, f"{case.name()}:\n{result.get('traceback', result['error'])}"
    return result


def _eager_logits(case: Case, folder: str) -> list[torch.Tensor]:
    if case.model == "gpt_tiny":
        model = build(case).eval()
        model.load_state_dict(_folder_state(case))
        with torch.no_grad():
            return [model(x) for x, _ in batches(case, model.cfg.vocab_size)]
    model = _library_model(case, folder)
    with torch.no_grad():
        return [model(x).logits for x, _ in batches(case, model.config.vocab_size)]


@pytest.mark.parametrize("case", _cases_of("pretrained_logits"))
def test_pretrained_folder_gives_the_eager_logits(case):
    result = _result(case)
    folder = dict(case.extra)["folder"]
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json")) == (case.model == "hf_llama")
    eager = _eager_logits(case, folder)
    for rank, mine in enumerate(result["rank_results"]):  # every rank returns the logits (dp=1: the whole batch)
        for got, expected in zip(mine["outputs"], eager, strict=True):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")
        report = mine["report"]  # each rank read what it holds and nothing else
        assert report.elements_read == mine["held_elements"] < report.checkpoint_elements, f"rank {rank}"
    expected = _folder_state(case)
    assert set(result["state"]) == set(expected)
    for key, value in result["state"].items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("case", _cases_of("train_save"))
def test_trained_and_saved_folder_loads_in_transformers(case):
    import transformers
    result = _result(case)
    extra = dict(case.extra)
    pretrained = _library_model(case, extra["folder"])
    for key, value in result["loaded"].items():
        assert torch.equal(value, pretrained.state_dict()[key]), key
    assert_equivalent(case, result, _reference_from(case, pretrained))
    out = extra["out"]
    files = sorted(os.listdir(out))
    assert "config.json" in files and (("model.safetensors.index.json" in files) == ("shard" in extra)), files
    saved, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert type(saved) is type(pretrained)
    for key, value in saved.state_dict().items():
        assert torch.equal(value, result["state"][key]), key
    local = case.batch // case.mesh[0]
    with torch.no_grad():
        logits = [saved.eval()(x).logits for x, _ in batches(case, saved.config.vocab_size)]
    for rank, mine in enumerate(result["rank_results"]):  # each rank's logits: its own dp slice of the batch
        start = mine["coords"]["dp"] * local
        for got, expected in zip(mine["outputs"], logits, strict=True):
            torch.testing.assert_close(got, expected[start:start + local], rtol=RTOL, atol=1e-5,
                                       msg=lambda m, r=rank: f"rank {r}: {m}")
    assert not [f for f in os.listdir(_root()) if f.startswith(".")], "a temporary folder was left behind"


@pytest.mark.parametrize("case", _cases_of(":loaded"))
def test_pretrained_weights_set_zero3_blocks_and_fp32_masters_with_their_bf16_copies(case):
    result = _result(case)
    expected = _folder_state(case)
    assert set(result["state"]) == set(expected)
    for key, value in result["state"].items():
        assert torch.equal(value, expected[key]), key
    if dict(case.options).get("precision") == "bf16":  # every rank's copies, not rank 0's alone
        assert [(r["compute_dtype"], r["rounded"]) for r in result["rank_results"]] == \
            [("torch.bfloat16", True)] * case.world_size


def _reference_from(case: Case, pretrained) -> dict:
    """One device, from the folder's weights: the losses and weights the parallel run must reach."""
    from autopar.models import lm_loss
    model = build(case)
    model.load_state_dict(pretrained.state_dict())
    opt = make_optimizer(case)(list(model.parameters()))
    losses = []
    for x, y in batches(case, model.cfg.vocab_size):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}

