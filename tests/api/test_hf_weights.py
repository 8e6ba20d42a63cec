"""autopar.hf in one process: slice reads equal the checkpoint layout's cut, names map across
wrappers and base models, and every refusal is a CheckpointError with what, where and fix.

A one-rank gloo group (a FileStore, no network) is enough to compile; the 4-rank cases (pp=2 x
tp=2, ZeRO-3) are in tests/api/test_hf_weights_dist.py.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import CheckpointError
from autopar.hf.folder import PretrainedFolder
from autopar.hf.load import read_piece
from autopar.hf.names import checkpoint_to_program
from autopar.ir.shard_layout import ShardLayout
from autopar.runtime.checkpoints.checkpoint_layout import Layout, split

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None,
    reason="needs transformers and safetensors (the [test] extra)")




def _tokens():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _llama(seed: int, **overrides):
    import transformers
    from autopar.models.hf import build_hf_model
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return build_hf_model("hf_llama", **overrides)


def _library(model):
    """The library's own class with ``model``'s weights (what a user's checkpoint comes from)."""
    library = type(model).__mro__[1](model.config)
    library.load_state_dict(model.state_dict())
    return library.eval()


def _program(one_rank_mesh, model):
    return autopar.compile(model, one_rank_mesh, example_inputs=(_tokens(),))


def _check(info, *, what: str, fix: str):
    err = info.value
    assert type(err) is autopar.CheckpointError
    assert what in err.what, err.what
    assert err.where and fix in (err.fix or ""), (err.where, err.fix)


def _tp(dim: int, chunks: int, size: int) -> dict:
    """A Layout's tensor-parallel cut: ``chunks`` equal blocks of ``dim``, each over ``size`` ranks."""
    return {"tp": ShardLayout(dim, chunks=chunks), "tp_size": size}


# -- slices ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [
    Layout((6, 4)), Layout((6, 4), **_tp(0, 1, 2)), Layout((6, 4), **_tp(1, 1, 2)), Layout((6, 4), **_tp(0, 3, 2)),
    Layout((4, 6), **_tp(1, 3, 2)), Layout((6, 4), z3=4), Layout((6, 4), **_tp(0, 3, 2), z3=5),
    Layout((4, 6), **_tp(1, 3, 2), z3=3), Layout((5,), z3=2), Layout((2, 3, 4), **_tp(2, 2, 2), z3=4), Layout(()),
    # a fused [q | k | v] with fewer kv heads (unequal blocks): the q rows of the rank, k and v whole
    Layout((8, 3), tp=ShardLayout(0, blocks=((4, 0), (2, 1), (2, 1))), tp_size=2), Layout((8, 3), tp=ShardLayout(0, blocks=((4, 0), (2, 1), (2, 1))), tp_size=2, z3=3),
    Layout((3, 8), tp=ShardLayout(1, blocks=((4, 0), (2, 2), (2, 2))), tp_size=4, z3=2),
], ids=str)
def test_a_read_piece_is_the_layouts_cut(layout, tmp_path):
    from safetensors.torch import save_file
    full = torch.randn(layout.shape, dtype=torch.float64).to(torch.bfloat16)  # read into fp32: cast on the way
    save_file({"w": full}, os.fspath(tmp_path / "model.safetensors"))
    folder = PretrainedFolder(os.fspath(tmp_path))
    read = 0
    for _, t, z in layout.pieces("w"):
        piece = read_piece(folder, "w", layout, tp_index=t, z_index=z, dtype=torch.float32)
        assert torch.equal(piece, split(full.float(), layout, tp_index=t, z_index=z))
        if not layout.z3:  # without ZeRO-3 a rank reads exactly its piece
            assert folder.elements_read - read == piece.numel()
        read = folder.elements_read
    assert folder.elements_read >= max(1, full.numel())


def test_names_map_across_wrappers_and_base_models():
    program = ["hf.model.embed_tokens.weight", "hf.model.norm.weight", "hf.lm_head.weight"]
    assert checkpoint_to_program(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], program) == {
        "model.embed_tokens.weight": "hf.model.embed_tokens.weight", "model.norm.weight": "hf.model.norm.weight",
        "lm_head.weight": "hf.lm_head.weight"}
    base = checkpoint_to_program(["embed_tokens.weight", "norm.weight"], [p[3:] for p in program])
    assert base == {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    head_into_base = checkpoint_to_program(["model.norm.weight", "lm_head.weight"], ["norm.weight"])
    assert head_into_base == {"model.norm.weight": "norm.weight"}  # lm_head.weight: reported as unexpected


# -- in and out on one rank -------------------------------------------------------------------------
class CausalLM(nn.Module):
    """The tutorial's wrapper: the library model one attribute down (names gain ``hf.``)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, tokens):
        return self.hf(input_ids=tokens, use_cache=False).logits


def test_a_wrapped_model_loads_a_base_model_checkpoint_and_saves_the_library_names(one_rank_mesh, tmp_path):
    import transformers
    source = _library(_llama(1))
    source.model.save_pretrained(tmp_path / "base")  # LlamaModel: no "model." prefix, no head (tied to the embedding)
    wrapped = CausalLM(_library(_llama(2)))
    program = _program(one_rank_mesh, wrapped)
    wrapped.to("meta")  # nothing is asked of the model's own weights: the program's tensors are filled
    report = autopar.hf.load_pretrained(program, os.fspath(tmp_path / "base"))
    assert report.elements_read == report.checkpoint_elements  # one rank holds everything
    with torch.no_grad():
        torch.testing.assert_close(program(_tokens()), source(_tokens()).logits, rtol=1e-5, atol=1e-6)
    folder = autopar.hf.save_pretrained(program, os.fspath(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(back) is transformers.LlamaForCausalLM
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    for key, value in source.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    autopar.hf.save_pretrained(program, folder, overwrite=True, dtype=torch.bfloat16)  # replaced as a whole
    assert transformers.AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16
    assert sorted(os.listdir(tmp_path)) == ["base", "out", "store"]  # no temporary folder left behind


def test_library_patterns_for_unexpected_names_are_ignored(one_rank_mesh, tmp_path):
    from safetensors.torch import load_file, save_file
    import transformers
    from autopar.models.hf import build_hf_model
    transformers.logging.set_verbosity_error()
    torch.manual_seed(3)
    gpt2 = build_hf_model("hf_gpt2")
    _library(gpt2).save_pretrained(tmp_path / "gpt2")
    path = os.fspath(tmp_path / "gpt2" / "model.safetensors")
    tensors = load_file(path)
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # old GPT-2 checkpoints hold the causal mask
    save_file(tensors, path, metadata={"format": "pt"})
    torch.manual_seed(4)
    program = _program(one_rank_mesh, build_hf_model("hf_gpt2"))
    autopar.hf.load_pretrained(program, os.fspath(tmp_path / "gpt2"))
    for key, value in gpt2.state_dict().items():
        assert torch.equal(program.full_state_dict()[key], value), key


# -- refusals ---------------------------------------------------------------------------------------
def test_missing_or_unreadable_folders_are_refused(one_rank_mesh, tmp_path):
    program = _program(one_rank_mesh, _llama(2))
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.load_pretrained(program, os.fspath(tmp_path / "nowhere"))
    _check(info, what="does not exist", fix="config.json and model.safetensors")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.load_pretrained(program, os.fspath(tmp_path / "bin"))
    _check(info, what="holds no model.safetensors", fix="save_pretrained(new_folder) writes safetensors")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.load_pretrained(program, os.fspath(tmp_path / "bad"))
    _check(info, what="not a readable safetensors file", fix="again")


@pytest.mark.parametrize("other,what", [
    ({"num_hidden_layers": 1}, "missing from the checkpoint: ['model.layers.1"),
    ({"num_hidden_layers": 3}, "not in the model: ['model.layers.2"),
    ({"intermediate_size": 48},
     "shape mismatches: ['model.layers.0.mlp.gate_proj.weight: checkpoint (48, 32) vs model (64, 32)"),
], ids=["fewer_layers", "more_layers", "other_width"])
def test_a_checkpoint_of_another_model_is_refused_and_nothing_changes(one_rank_mesh, tmp_path, other, what):
    _library(_llama(1, **other)).save_pretrained(tmp_path / "other")
    program = _program(one_rank_mesh, _llama(2))
    before = {k: v.clone() for k, v in program.full_state_dict().items()}
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.load_pretrained(program, os.fspath(tmp_path / "other"))
    _check(info, what=what, fix="AutoConfig.from_pretrained(folder)")
    assert all(torch.equal(v, before[k]) for k, v in program.full_state_dict().items())


def test_saving_refuses_an_occupied_folder_and_a_model_without_a_library_model(one_rank_mesh, tmp_path):
    program = _program(one_rank_mesh, _llama(2))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.save_pretrained(program, os.fspath(tmp_path / "taken"))
    _check(info, what="exists and is not empty", fix="overwrite=True")
    assert os.listdir(tmp_path / "taken") == ["notes.txt"]
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.save_pretrained(program, os.fspath(tmp_path / "x"), max_shard_size="lots")
    _check(info, what="is not a size", fix="'5GB'")
    plain = autopar.compile(nn.Sequential(nn.Linear(8, 8)), program.compile_args["mesh"],
                            example_inputs=(torch.randn(2, 8),))
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.save_pretrained(plain, os.fspath(tmp_path / "plain"))
    _check(info, what="holds no transformers model", fix="config=")

    class Extra(CausalLM):
        def __init__(self, hf_model):
            super().__init__(hf_model)
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, tokens):
            return super().forward(tokens) * self.scale

    extra = autopar.compile(Extra(_library(_llama(2))), program.compile_args["mesh"], example_inputs=(_tokens(),))
    with pytest.raises(autopar.CheckpointError) as info:
        autopar.hf.save_pretrained(extra, os.fspath(tmp_path / "extra"))
    _check(info, what="outside the transformers model", fix="full_state_dict")
    assert sorted(os.listdir(tmp_path)) == ["store", "taken"]


def test_weights_for_a_model_with_real_tensors_are_refused_not_ignored(one_rank_mesh, tmp_path):
    source = _library(_llama(1))
    source.save_pretrained(tmp_path / "llama")
    model = CausalLM(_library(_llama(2)))  # real tensors: a filler has nothing to fill
    with pytest.raises(autopar.errors.InputError, match="holds real tensors: the weights would be ignored") as info:
        autopar.compile(model, one_rank_mesh, example_inputs=(_tokens(),),
                        weights=autopar.hf.pretrained_weights(os.fspath(tmp_path / "llama"), model))
    assert info.value.where == "compile(weights=...)" and "torch.device('meta')" in info.value.fix


def test_pretrained_weights_fill_a_meta_built_model_and_refuse_a_filler_for_another_module(one_rank_mesh, tmp_path):
    source = _library(_llama(1))
    source.save_pretrained(tmp_path / "llama")
    folder = os.fspath(tmp_path / "llama")
    with torch.device("meta"):
        wrapped = CausalLM(_library(_llama(2)))
    with pytest.raises(CheckpointError, match="made for LlamaForCausalLM") as info:
        autopar.compile(wrapped, one_rank_mesh, example_inputs=(_tokens(),),
                        weights=autopar.hf.pretrained_weights(folder, wrapped.hf))  # not the compiled module
    assert "pass the very module you compile" in info.value.fix
    program = autopar.compile(wrapped, one_rank_mesh, example_inputs=(_tokens(),),
                              weights=autopar.hf.pretrained_weights(folder, wrapped))
    assert all(p.is_meta for p in wrapped.parameters())  # the user's model stays unallocated
    with torch.no_grad():
        torch.testing.assert_close(program(_tokens()), source(_tokens()).logits, rtol=1e-5, atol=1e-6)
