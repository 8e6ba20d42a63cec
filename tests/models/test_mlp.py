"""MLP: shape, layer stack, seeded construction."""
from __future__ import annotations

import torch
from torch import nn

from autopar.models import MLP, MLPConfig


def test_shape_and_stack():
    model = MLP(MLPConfig(in_features=8, hidden=16, num_layers=3, out_features=4))
    assert model(torch.randn(5, 8)).shape == (5, 4)
    kinds = [type(m) for m in model.layers]
    assert kinds == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]


def test_single_layer_is_one_linear():
    model = MLP(MLPConfig(in_features=8, hidden=16, num_layers=1, out_features=4))
    assert [type(m) for m in model.layers] == [nn.Linear]


def test_reset_parameters_redraws_the_constructor_weights():
    cfg = MLPConfig(in_features=8, hidden=16, num_layers=3, out_features=4)
    torch.manual_seed(0)
    eager = MLP(cfg)
    with torch.device("meta"):
        lazy = MLP(cfg)
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.reset_parameters()
    for a, b in zip(lazy.parameters(), eager.parameters()):
        assert torch.equal(a, b)
