"""The tiny models export (torch.export, non-strict) into the aten ops the sharding passes match."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from autopar.models import build_model


def _ops(exported: torch.export.ExportedProgram) -> Counter:
    return Counter(str(n.target) for n in exported.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_export_keeps_linear_view_and_sdpa(name):
    torch.manual_seed(0)
    model = build_model(name)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
    exported = torch.export.export(model, (idx,), strict=False)
    ops = _ops(exported)
    num_layers = model.cfg.num_layers
    linears_per_layer = 4 if name == "gpt_tiny" else 7
    assert ops["aten.linear.default"] == linears_per_layer * num_layers + 1  # + lm_head
    assert ops["aten.view.default"] == 4 * num_layers
    assert ops["aten.scaled_dot_product_attention.default"] == num_layers
    if name == "gpt_tiny":
        assert ops["aten.split.Tensor"] == num_layers
    torch.testing.assert_close(exported.module()(idx), model(idx))


def test_export_on_meta_device():
    with torch.device("meta"):
        model = build_model("llama_tiny")
        idx = torch.zeros(2, 16, dtype=torch.long)
    exported = torch.export.export(model, (idx,), strict=False)
    assert _ops(exported)["aten.scaled_dot_product_attention.default"] == model.cfg.num_layers
