"""runtime/execution/numerics.py without processes: the fused finite check and the message naming the bad tensor."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopar.runtime.execution.numerics import all_finite, local_nonfinite

INF, NAN = float("inf"), float("nan")


def _program(**grads):
    """A stand-in for RankProgram: one stage holding parameters whose gradients are ``grads``."""
    named = []
    for name, grad in grads.items():
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        named.append((name, p))
    stage = SimpleNamespace(param_names=tuple(grads))
    return SimpleNamespace(named_params=named, stages={1: stage})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_one_non_finite_element_anywhere_is_caught(dtype, value):
    for position in (0, 500, 999):
        bad = torch.randn(1000).to(dtype)
        bad[position] = value
        assert not all_finite([torch.randn(3, 3), bad, torch.randn(7)])
    assert all_finite([torch.randn(3, 3), torch.randn(1000).to(dtype), torch.empty(0)])


def test_plus_inf_and_minus_inf_in_two_tensors_do_not_cancel():
    plus, minus = torch.zeros(8), torch.zeros(8)
    plus[2], minus[5] = INF, -INF
    assert not all_finite([plus, minus])
    both = torch.zeros(8)
    both[1], both[6] = INF, -INF  # one tensor: its sum is NaN
    assert not all_finite([both])


def test_the_message_names_the_first_bad_gradient_and_its_value():
    good, plus, minus = torch.ones(4), torch.ones(4), torch.ones(4)
    plus[3], minus[0] = INF, -INF
    found = local_nonfinite(_program(**{"a.weight": good, "b.weight": plus, "c.weight": minus}), {})
    assert found == "the gradient of b.weight holds inf (stage 1)"
    nan = torch.ones(4)
    nan[1] = NAN
    assert local_nonfinite(_program(**{"a.weight": good, "b.weight": nan}), {}) == \
        "the gradient of b.weight holds nan (stage 1)"


def test_a_bad_loss_is_named_before_the_gradients():
    grad = torch.ones(4)
    grad[0] = NAN
    results = {0: torch.tensor(1.5), 1: (torch.tensor(NAN), torch.zeros(2))}
    assert local_nonfinite(_program(w=grad), results) == "the loss of microbatch 1 is nan (stage 1)"


def test_finite_values_whose_sum_overflows_are_not_reported():
    huge = torch.full((4,), 3e38)  # each finite, the sum is inf: the search finds nothing to report
    assert not all_finite([huge])
    assert local_nonfinite(_program(w=huge), {0: torch.tensor(2.0)}) is None
    assert local_nonfinite(_program(w=torch.ones(3)), {0: torch.tensor(2.0)}) is None


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_views_of_one_flat_buffer_are_checked_as_that_buffer(value):
    flat = torch.randn(30)
    views = [flat[0:10].view(2, 5), flat[10:12], flat[12:30].view(3, 6)]  # a dp bucket's written-back gradients
    assert all_finite(views + [torch.randn(4)])
    for position in (0, 11, 29):
        flat[position] = value
        assert not all_finite(views + [torch.randn(4)])
        named = {f"w{i}": v for i, v in enumerate(views)}
        which = "w0" if position < 10 else "w1" if position < 12 else "w2"
        assert local_nonfinite(_program(**named), {}).startswith(f"the gradient of {which} holds")
        flat[position] = 1.0


def test_a_non_finite_value_beside_the_views_is_searched_for_and_not_reported():
    flat = torch.randn(12)
    flat[11] = NAN  # inside the storage, in no tensor checked
    views = [flat[0:5], flat[5:10]]
    assert not all_finite(views)
    assert local_nonfinite(_program(a=views[0], b=views[1]), {}) is None
