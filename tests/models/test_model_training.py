"""gpt_tiny learns from the corpus: the loss falls over 20 AdamW steps."""
from __future__ import annotations

import torch

from autopar.models import TextBatches, build_model, lm_loss


def test_loss_decreases_on_corpus():
    torch.manual_seed(0)
    model = build_model("gpt_tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in TextBatches(seq_len=32, batch_size=16, seed=0, num_batches=20):
        loss = lm_loss(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
