"""runtime/execution/weight_versions.py against numbers computed by hand: PipeMare's weight correction and velocity,
and the bookkeeping of a stage's weight versions (snapshots kept, pending updates applied in order)."""
from __future__ import annotations

import pytest
import torch

from autopar.errors import RuntimeCommError
from autopar.runtime.execution.weight_versions import WeightVersions, corrected_weights, update_velocity


def test_correction_moves_the_newest_weights_back_by_lag_times_delta():
    w, delta = [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])], [torch.tensor([0.25, 0.5]), torch.tensor([[-1.0]])]
    lag2 = corrected_weights(w, delta, 2)  # w - 2 * delta, by hand
    assert lag2[0].tolist() == [0.5, -3.0] and lag2[1].tolist() == [[2.5]]
    lag1 = corrected_weights(w, delta, 1)
    assert lag1[0].tolist() == [0.75, -2.5] and lag1[1].tolist() == [[1.5]]
    assert w[0].tolist() == [1.0, -2.0] and delta[0].tolist() == [0.25, 0.5]  # inputs untouched


def test_no_lag_is_a_copy_of_the_weights():
    w = [torch.tensor([3.0, 4.0])]
    same = corrected_weights(w, [torch.tensor([9.0, 9.0])], 0)
    assert same[0].tolist() == [3.0, 4.0]
    same[0].add_(1.0)
    assert w[0].tolist() == [3.0, 4.0]  # a new tensor: a step on it never writes into the live weights


def test_velocity_is_the_decayed_average_of_the_steps():
    delta = [torch.tensor([1.0, 0.0])]
    update_velocity(delta, [torch.tensor([2.0, 2.0])], [torch.tensor([1.0, 3.0])], decay=0.75)
    assert delta[0].tolist() == [0.75 * 1.0 + 0.25 * -1.0, 0.75 * 0.0 + 0.25 * 1.0]  # [0.5, 0.25]
    update_velocity(delta, [torch.tensor([1.0, 3.0])], [torch.tensor([1.0, 3.0])], decay=0.5)
    assert delta[0].tolist() == [0.25, 0.125]  # no step: the average decays
    update_velocity(delta, [torch.tensor([0.0, 0.0])], [torch.tensor([4.0, -4.0])], decay=0.0)
    assert delta[0].tolist() == [4.0, -4.0]  # decay 0: the last step alone


def _versions():
    w = torch.nn.Parameter(torch.tensor([10.0]))
    return w, WeightVersions([("w", w)])


def _sgd(w):
    return lambda k, grads: w.data.sub_(grads[0])


def test_updates_apply_in_order_and_each_version_is_kept_until_released():
    w, versions = _versions()
    v0 = versions.read(0, copy=True, microbatch=0)
    versions.accumulate(0, [torch.tensor([1.0])])
    versions.accumulate(0, [torch.tensor([2.0])])  # two microbatches of update 0: summed
    versions.apply_through(1, _sgd(w))
    v1 = versions.read(1, copy=True, microbatch=1)
    versions.accumulate(1, [torch.tensor([4.0])])
    versions.apply_through(2, _sgd(w))
    assert w.item() == 10.0 - 3.0 - 4.0 and versions.applied == 2
    assert (v0[0].item(), v1[0].item()) == (10.0, 7.0)  # each reader's copy untouched by later updates
    assert versions.held == {0, 1}
    versions.done(0)  # microbatch 0's backward ran: version 0's copy goes
    assert versions.held == {1}
    versions.done(1)
    assert versions.held == set() and versions.buffers() == []
    with pytest.raises(RuntimeCommError, match="weight version 1 is read while the live weights are version 2"):
        versions.read(1, copy=True, microbatch=2)


def test_a_version_read_before_its_gradient_exists_is_an_error():
    w, versions = _versions()
    with pytest.raises(RuntimeCommError, match="before the gradient of update 0 exists"):
        versions.apply_through(1, _sgd(w))


def test_the_drain_applies_every_update_whose_gradient_arrived():
    w, versions = _versions()
    seen = []
    versions.accumulate(0, [torch.tensor([1.0])])
    versions.accumulate(1, [None])  # a parameter this microbatch did not use: no gradient, a zero one
    versions.accumulate(3, [torch.tensor([5.0])])  # update 2 missing: the drain stops before it
    versions.apply_pending(lambda k, grads: seen.append((k, grads[0].item())) or w.data.sub_(grads[0]))
    assert seen == [(0, 1.0), (1, 0.0)] and versions.applied == 2 and w.item() == 9.0


def test_the_drain_applies_a_single_pending_update_alone():
    w, versions = _versions()
    versions.accumulate(0, [torch.tensor([2.0])])
    versions.apply_pending(_sgd(w))  # update 1 has no gradient yet: the drain stops after update 0
    assert versions.applied == 1 and w.item() == 8.0
