"""Presets: names, parameter counts on meta, overrides, errors that list the known names."""
from __future__ import annotations

import pytest
import torch

from autopar.errors import PlanError
from autopar.models import CharTokenizer, GPT, Llama, MLP, build_model, get_config, preset_names

# Published sizes (head tied in GPT, untied in Llama), counted on the meta device.
KNOWN_COUNTS = {
    "gpt2_medium": 354_823_168,
    "llama2_7b": 6_738_415_616,
    "llama3_70b": 70_553_706_496,
}


def test_names():
    names = preset_names()
    for name in ("gpt_tiny", "gpt2_small", "gpt2_medium", "gpt3_175b", "llama_tiny", "llama2_7b",
                 "llama2_70b", "llama3_70b", "mlp_tiny"):
        assert name in names
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", sorted(KNOWN_COUNTS))
def test_known_parameter_counts(name):
    with torch.device("meta"):
        model = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == KNOWN_COUNTS[name]


def test_gpt3_shape():
    cfg = get_config("gpt3_175b")
    assert (cfg.num_layers, cfg.num_heads, cfg.hidden, cfg.vocab_size, cfg.seq_len) == (
        96, 96, 12288, 50257, 2048)


def test_tiny_presets_use_the_tokenizer_vocabulary():
    vocab = CharTokenizer().vocab_size
    assert get_config("gpt_tiny").vocab_size == vocab
    assert get_config("llama_tiny").vocab_size == vocab


def test_build_kinds_and_overrides():
    assert isinstance(build_model("gpt_tiny"), GPT)
    assert isinstance(build_model("mlp_tiny"), MLP)
    model = build_model("llama_tiny", num_layers=1)
    assert isinstance(model, Llama) and len(model.layers) == 1


def test_unknown_name_lists_known_names():
    with pytest.raises(PlanError) as info:
        build_model("gpt5")
    assert "gpt5" in str(info.value)
    for name in preset_names():
        assert name in str(info.value)


def test_unknown_override_is_a_plan_error():
    with pytest.raises(PlanError, match="num_kv_heads"):
        build_model("gpt_tiny", num_kv_heads=2)
