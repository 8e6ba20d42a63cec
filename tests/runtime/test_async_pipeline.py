"""Asynchronous schedules: the distributed runtime reproduces the single-process emulation of each rule.

The emulation (runtime/async_emulation.py) is plain torch on the unsplit model; the rules are data
(runtime/schedules/staleness.py). Spawned cases: tests/schedule_runners.py (pp=2 for each rule, and
2BW with GPT's tied weight on dp=2 x pp=2).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.models import build_model, lm_loss
from autopar.runtime.async_emulation import StageLayout, emulate
from autopar.runtime.schedules import StageCosts, StalenessRule, simulate
from autopar.runtime.schedules.asynchronous import pipedream, pipedream_2bw, pipemare, stream_segment
from case_marks import by_world
from equivalence import ATOL, RTOL, build, make_optimizer
from schedule_runners import ASYNC_CASES, ASYNC_DICT_CASES, results


def _emulate(case, result, rule=None):
    layout = StageLayout(result["layout"]["param_stages"], result["layout"]["stage_starts"])
    return emulate(build(case), rule=rule or result["rule"], layout=layout,
                   batches=[((x,), y) for x, y in result["data"]], num_microbatches=result["num_microbatches"],
                   loss_fn=lm_loss, optimizer=make_optimizer(case), dp=case.mesh[0],
                   count_tokens=lambda target: (target != -100).sum())  # lm_loss is a token mean


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(ASYNC_CASES, ids=lambda c: c.name()))
def test_distributed_run_is_the_emulated_staleness_rule(case):
    result = results(case.world_size)[case]
    assert "error" not in result, result.get("traceback", result.get("error"))
    expected = _emulate(case, result)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected.losses), rtol=RTOL, atol=0)
    assert set(result["state"]) == set(expected.state)
    for key, value in expected.state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
    # the check has teeth: another rule gives other weights
    rule = result["rule"]
    other = StalenessRule(kind="2bw", num_stages=rule.num_stages,  # another update cadence
                          updates_every=1 if rule.kind == "2bw" else result["num_microbatches"])
    wrong = _emulate(case, result, other)
    assert any(not torch.allclose(wrong.state[k], v, rtol=RTOL, atol=ATOL) for k, v in expected.state.items())
    # the loss falls on real text, and the runtime held the weight versions the simulator counts
    assert result["losses"][-1] < result["losses"][0]
    generate = {"pipedream": pipedream, "pipedream_2bw": pipedream_2bw, "pipemare": pipemare}[
        dict(case.options)["schedule"]]
    schedule = generate(num_ranks=case.mesh[1], num_microbatches=result["num_microbatches"], num_batches=case.steps)
    predicted = simulate(schedule, costs=StageCosts(forward=1, backward=1, weight=0)).weight_versions_per_rank
    # never more than the rule needs; fewer where a lazy update keeps a gradient instead of a version
    pp_of = [(rank // case.mesh[2]) % case.mesh[1] for rank in range(case.world_size)]
    assert all(held <= predicted[pp_of[rank]] for rank, held in enumerate(result["peak_versions"]))
    assert max(result["peak_versions"]) == max(predicted)


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(ASYNC_DICT_CASES, ids=lambda c: c.name()))
def test_dict_batches_on_the_models_own_loss_count_label_tokens_per_update(case):
    """PipeDream updates after every microbatch: each microbatch's own label tokens divide its loss
    sum, so a dict batch on the model's own loss trains as positional inputs with a mean loss_fn."""
    from equivalence import assert_equivalent
    result = results(case.world_size)[case]
    assert_equivalent(case, result, result.get("reference", {}))


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_rules_are_the_published_formulas(p, m):
    dream, mare = StalenessRule(kind="pipedream", num_stages=p), StalenessRule(kind="pipemare", num_stages=p)
    two = StalenessRule(kind="2bw", num_stages=p, updates_every=m)
    for s in range(p):
        for i in range(3 * m + p):
            assert dream.forward_version(s, i) == dream.backward_version(s, i) == max(0, i - (p - 1 - s))
            assert mare.forward_version(s, i) == max(0, i - (p - 1 - s)) and mare.backward_version(s, i) == i
            assert two.forward_version(s, i) == two.backward_version(s, i) == max(0, i // m - 1)
    assert [two.closes_update(i) for i in range(2 * m)] == ([False] * (m - 1) + [True]) * 2


@pytest.mark.parametrize(("generate", "p", "m"), [(pipedream, 3, 2), (pipedream_2bw, 3, 3), (pipemare, 4, 1)])
def test_the_stream_order_gives_each_forward_the_version_its_rule_reads(generate, p, m):
    """Counting the updates each rank has finished before each action reproduces the rule exactly."""
    schedule = generate(num_ranks=p, num_microbatches=m, num_batches=4)
    rule = schedule.staleness
    for rank, row in enumerate(schedule.actions):
        backwards_done = 0
        for action in row:
            updates_done = backwards_done // rule.updates_every
            if action.kind.value == "F":
                assert rule.forward_version(rank, action.microbatch) <= updates_done
                if rule.kind != "2bw":  # no stash needed beyond the rule: the newest version is read
                    assert rule.forward_version(rank, action.microbatch) == updates_done
            else:
                assert rule.backward_version(rank, action.microbatch) <= updates_done
                backwards_done += 1


@pytest.mark.parametrize("p", [1, 2, 3])
def test_segments_per_batch_then_drain_make_the_stream_schedule(p):
    m, k = 2, 3
    schedule = pipedream(num_ranks=p, num_microbatches=m, num_batches=k)
    for rank in range(p):
        cursor, actions = (0, 0), []
        for t in list(range(k)) + [None]:
            part, cursor = stream_segment(rank=rank, num_ranks=p, next_forward=cursor[0], next_backward=cursor[1],
                                          end=None if t is None else (t + 1) * m - 1)
            actions += part
        assert tuple(actions) == schedule.actions[rank]


def test_simulated_weight_versions():
    costs = StageCosts(forward=1, backward=1, weight=0)
    assert simulate(pipedream(num_ranks=4, num_microbatches=4, num_batches=4), costs=costs
                    ).weight_versions_per_rank == (4, 3, 2, 1)
    assert simulate(pipedream_2bw(num_ranks=4, num_microbatches=4, num_batches=4), costs=costs).weight_versions == 2
    assert simulate(pipemare(num_ranks=4, num_microbatches=4, num_batches=4), costs=costs).weight_versions == 1
    # one fill and one drain for the whole stream: 2 (p - 1) idle slots per rank in 2N + 2 (p - 1)
    long = simulate(pipedream(num_ranks=4, num_microbatches=8, num_batches=64), costs=costs)
    assert long.mean_bubble == pytest.approx(6 / (2 * 512 + 6))


def test_emulation_of_one_stage_is_plain_per_microbatch_training():
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=1, seq_len=8)
    x = torch.randint(0, 128, (4, 8))
    layout = StageLayout({n: (0,) for n, _ in model.named_parameters()}, ())
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    got = emulate(model, rule=StalenessRule(kind="pipedream", num_stages=1), layout=layout,
                  batches=[((x,), x), ((x,), x)], num_microbatches=2, loss_fn=lm_loss, optimizer=sgd)
    reference = build_model("gpt_tiny", num_layers=1, seq_len=8)
    reference.load_state_dict(model.state_dict())
    opt = sgd(list(reference.parameters()))
    for _ in range(2):
        for chunk in x.chunk(2):
            opt.zero_grad()
            lm_loss(reference(chunk), chunk).backward()
            opt.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got.state[name], value)


# the weight version each microbatch of a 2-stage stream reads, written out by hand from the papers:
# PipeDream (Narayanan et al. 2019) updates after every microbatch; stage s of p reads the weights
# after i - (p - 1 - s) updates (the last stage the newest, stage 0 one behind), in forward and in
# backward (weight stashing). 2BW (Narayanan et al. 2021) updates once per batch of m = 2 with the
# batch's mean gradient, W(t+1) = W(t) - lr * grad f(W(t-1)): batches 0 and 1 both read W(0).
HAND_VERSIONS = {"pipedream": ([0, 0, 1, 2], [0, 1, 2, 3]), "2bw": ([0, 0, 0, 0], [0, 0, 0, 0])}
HAND_UPDATES_AFTER = {"pipedream": [0, 1, 2, 3], "2bw": [1, 3]}  # microbatches that close an update


def _hand_trace(kind: str, w0: float, w1: float, microbatches, lr: float, versions=None):
    """Scalar arithmetic, no autograd: out = w1 * (w0 * x), loss (out - y)^2, gradients by hand."""
    v0, v1 = versions or HAND_VERSIONS[kind]
    weights, grads, losses = [(w0, w1)], [], []
    for i, (x, y) in enumerate(microbatches):
        a, b = weights[v0[i]][0], weights[v1[i]][1]
        h = a * x
        d = 2 * (b * h - y)
        losses.append((b * h - y) ** 2)
        grads.append((d * b * x, d * h))  # d loss / d w0 (at stage 0's version), d loss / d w1
        if i in HAND_UPDATES_AFTER[kind]:
            n = 1 if kind == "pipedream" else 2
            g0, g1 = (sum(g[k] for g in grads[-n:]) / n for k in (0, 1))
            weights.append((weights[-1][0] - lr * g0, weights[-1][1] - lr * g1))
    return losses, weights[-1]


@pytest.mark.parametrize("kind", ["pipedream", "2bw"])
def test_emulation_follows_a_hand_computed_staleness_trace_at_p2_m2(kind):
    """Two stages of one scalar weight each, two batches of two microbatches, plain SGD: the emulation
    (which the distributed runtime is judged against above) gives the losses and weights of the trace
    computed by hand from the published update rules, not from runtime/schedules/staleness.py."""
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[1].weight.fill_(-0.75)
    xs, ys = [[1.0, 2.0], [-1.0, 0.5]], [[0.3, -0.2], [0.1, 0.4]]
    batches = [((torch.tensor(x).view(2, 1),), torch.tensor(y).view(2, 1)) for x, y in zip(xs, ys)]
    rule = StalenessRule(kind=kind, num_stages=2, **({"updates_every": 2} if kind == "2bw" else {}))
    layout = StageLayout({"0.weight": (0,), "1.weight": (1,)}, ("1",))
    got = emulate(model, rule=rule, layout=layout, batches=batches, num_microbatches=2,
                  loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    flat = [(x, y) for bx, by in zip(xs, ys) for x, y in zip(bx, by)]
    losses, (w0, w1) = _hand_trace(kind, 0.5, -0.75, flat, lr=0.1)
    assert got.losses == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-6)
    assert got.state["0.weight"].item() == pytest.approx(w0, rel=1e-6)  # fp32 against float64 arithmetic
    assert got.state["1.weight"].item() == pytest.approx(w1, rel=1e-6)
    # the trace has teeth: the same updates read at the newest weights (no staleness) end elsewhere
    newest = [0, 1, 2, 3] if kind == "pipedream" else [0, 0, 1, 1]
    _, fresh = _hand_trace(kind, 0.5, -0.75, flat, lr=0.1, versions=(newest, newest))
    assert abs(fresh[0] - w0) > 1e-3 * abs(w0)


def test_pipemare_rescales_the_rate_by_delay_then_releases_it():
    rule = StalenessRule(kind="pipemare", num_stages=4, lr_warmup_updates=10, correction_decay=0.5)
    assert rule.lr_scale(0, 0) == pytest.approx(1 / 3) and rule.lr_scale(3, 0) == 1.0
    assert rule.lr_scale(0, 5) == pytest.approx(3 ** -0.5) and rule.lr_scale(0, 10) == 1.0
    assert dataclasses.replace(rule, lr_warmup_updates=0).lr_scale(0, 0) == 1.0
