"""The token-mean weighting of a step (runtime/execution/item_count.py), in one process: weights against numbers
computed by hand, the weighted microbatch losses against torch's cross-entropy over the whole batch, the dp
count through a stand-in all-reduce, and a compiled program on one rank against one device."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import autopar
from autopar.ir.captured_graph import ItemCount
from autopar.models import build_model, lm_loss
from autopar.runtime.execution.item_count import add_item_counts, add_loss_weights, count_labels, weighted_loss

SPEC = ItemCount(labels="labels", shift=0, input="w")


def _microbatches(counts: list[int], *, width: int = 4) -> list[dict]:
    """One row of ``width`` labels per microbatch, its first ``count`` counted, the rest -100."""
    return [{"labels": torch.tensor([[7] * n + [-100] * (width - n)])} for n in counts]


class _OtherReplica:
    """Stands in for the program's CommGuard at dp=2: the all-reduce adds the other replica's totals."""

    def __init__(self, totals):
        self.totals = torch.tensor(totals)

    def run(self, op, fn, tensor, *, group, purpose):
        assert op == "all_reduce"
        tensor += self.totals.to(tensor.dtype)


def test_each_microbatch_weighs_its_tokens_over_the_steps():
    batches = _microbatches([3, 1, 0, 2])
    add_loss_weights(batches, SPEC)  # m = 4, N = 6: n_i * 4 / 6
    assert [b["w"].item() for b in batches] == pytest.approx([2.0, 2 / 3, 0.0, 4 / 3], rel=1e-7)


def test_an_update_of_one_token_gives_it_the_whole_weight():
    batches = _microbatches([0, 1, 0, 0])
    add_loss_weights(batches, SPEC, per_update=2)  # N of the first update is 1; the second has none
    assert [b["w"].item() for b in batches] == [0.0, 2.0, 0.0, 0.0]


def test_an_update_of_fewer_microbatches_counts_its_own_tokens():
    batches = _microbatches([3, 1, 0, 2])
    add_loss_weights(batches, SPEC, per_update=2)  # updates [3, 1] and [0, 2]: n_i * 2 / N_update
    assert [b["w"].item() for b in batches] == pytest.approx([1.5, 0.5, 0.0, 2.0], rel=1e-7)


def test_dp_counts_every_replicas_tokens_and_weighs_by_m_times_dp():
    batches = _microbatches([3, 1])
    add_loss_weights(batches, SPEC, dp_size=2, dp_group=None, guard=_OtherReplica([4]))  # N = 4 + 4 = 8
    assert [b["w"].item() for b in batches] == pytest.approx([3 * 4 / 8, 1 * 4 / 8], rel=1e-7)


def test_the_models_own_count_is_the_steps_tokens_over_m_times_dp():
    batches = [{"labels": torch.tensor([[1, 2, -100]])}, {"labels": torch.tensor([[3, 4, 5]])}]
    spec = ItemCount(labels="labels", shift=1)
    assert [int(count_labels(b["labels"], spec)) for b in batches] == [1, 2]  # the first label is shifted away
    add_item_counts(batches, spec, per_update=2, dp_size=2, guard=_OtherReplica([6]))
    assert [float(b[spec.input]) for b in batches] == [(3 + 6) / 4, (3 + 6) / 4]  # 2.25: a true division
    batches = [{"labels": torch.tensor([[1, 2, -100]])}, {"labels": torch.tensor([[3, 4, 5]])}]
    add_item_counts(batches, spec, per_update=1)
    assert [float(b[spec.input]) for b in batches] == [1.0, 2.0]


def test_a_microbatch_without_tokens_adds_nothing():
    assert weighted_loss(torch.tensor(float("nan")), torch.tensor(0.0)).item() == 0.0  # its mean is 0 / 0
    assert weighted_loss(torch.tensor(2.0), torch.tensor(0.5)).item() == 1.0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=6), st.integers(0, 2 ** 16))
def test_weighted_microbatch_means_are_the_token_mean_of_the_whole_batch(counts, seed):
    """mean_i(mean_i * w_i) over the microbatches is F.cross_entropy over all of them at once."""
    g = torch.Generator().manual_seed(seed)
    batches = _microbatches(counts, width=6)
    logits = [torch.randn(1, 6, 5, generator=g, dtype=torch.float64) for _ in counts]
    for b in batches:
        b["labels"] = torch.where(b["labels"] >= 0, torch.randint(0, 5, (1, 6), generator=g), b["labels"])
    add_loss_weights(batches, SPEC)
    means = [F.cross_entropy(x.view(-1, 5), b["labels"].view(-1)) for x, b in zip(logits, batches)]
    step = torch.stack([weighted_loss(m, b["w"].double()) for m, b in zip(means, batches)]).mean()
    whole = F.cross_entropy(torch.cat(logits).view(-1, 5), torch.cat([b["labels"] for b in batches]).view(-1))
    if sum(counts) == 0:
        assert step.item() == 0.0  # no token anywhere: nothing to learn (torch's mean is 0 / 0)
    else:
        torch.testing.assert_close(step, whole, rtol=1e-6, atol=0)  # the weights are fp32


def test_a_one_rank_program_of_four_microbatches_trains_on_the_batchs_token_mean(one_rank_mesh):
    """Targets padded with -100, fewer tokens in later microbatches: the executor weighs each microbatch's
    token mean, and two steps of SGD equal one device's on the whole batch."""
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=1, seq_len=8)
    reference = build_model("gpt_tiny", num_layers=1, seq_len=8)
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 128, (8, 8), generator=g), torch.randint(0, 128, (8, 8), generator=g)) for _ in range(2)]
    for _, y in data:
        for r in range(8):
            y[r, 8 - r:] = -100  # row r keeps 8 - r tokens: microbatch 0 holds 30, microbatch 3 holds 6
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    program = autopar.compile(model, one_rank_mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=sgd, num_microbatches=4)
    assert program.captured.loss_weight is not None  # lm_loss was seen as a token mean (passes/frontend/mean_loss.py)
    opt = sgd(list(reference.parameters()))
    for x, y in data:
        loss = program.train_step(x, target=y)
        opt.zero_grad()
        expected = lm_loss(reference(x), y)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    state = program.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
