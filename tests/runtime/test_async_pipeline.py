"""Asynchronous schedules: the distributed runtime reproduces an oracle of each rule that shares no code with it.

The oracle (tests/async_oracle.py) is a plain loop on the unsplit model that keeps every stage's weight
versions by hand, its rules written from the papers; it imports nothing from autopar. The tests tell it
the rule by the schedule's name and the stage cut literally (:data:`STAGE_STARTS`, checked against the
program's plan, never read from it). Hand-computed two-stage traces pin the oracle itself: which version
each microbatch's forward and backward read, written out below. Spawned cases: tests/schedule_runners.py.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from async_oracle import Oracle, run_oracle
from autopar.models import build_model, lm_loss
from autopar.runtime.schedules import StageCosts, StalenessRule, simulate
from autopar.runtime.schedules.asynchronous import pipedream, pipedream_2bw, pipemare, stream_segment
from case_marks import by_world
from equivalence import ATOL, RTOL, build, make_optimizer
from schedule_runners import ASYNC_CASES, ASYNC_DICT_CASES, results

#: where the tiny models' two stages are cut (the partitioner's cost-balanced cut of two equal blocks)
STAGE_STARTS = {"llama_tiny": ("layers.1",), "gpt_tiny": ("blocks.1",)}
#: the rule of each schedule name, and compile's documented PipeMare defaults (docs/api.md)
KINDS = {"pipedream": "pipedream", "pipedream_2bw": "2bw", "pipemare": "pipemare"}
PIPEMARE_DEFAULTS = {"pipemare_lr_warmup_updates": 100, "pipemare_correction_decay": 0.5}


def _oracle_of(case, **change) -> Oracle:
    """The rule and cut of ``case``, from its own options and the literal cut above."""
    options = {**PIPEMARE_DEFAULTS, **dict(case.options)}
    o = Oracle(kind=KINDS[options["schedule"]], num_stages=case.mesh[1], num_microbatches=options["num_microbatches"],
               stage_starts=STAGE_STARTS[case.model], lr_warmup_updates=options["pipemare_lr_warmup_updates"],
               correction_decay=options["pipemare_correction_decay"], max_grad_norm=options.get("max_grad_norm"))
    return dataclasses.replace(o, **change)


def _oracle_run(case, result, oracle: Oracle):
    padded = dict(case.extra).get("padded_targets")
    return run_oracle(build(case), oracle, batches=[((x,), y) for x, y in result["data"]], loss_fn=lm_loss,
                      optimizer=make_optimizer(case), dp=case.mesh[0],
                      count_tokens=(lambda target: (target != -100).sum()) if padded else None)


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(ASYNC_CASES, ids=lambda c: c.name()))
def test_distributed_run_is_the_oracle_of_its_rule(case):
    result = results(case.world_size)[case]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["layout"]["stage_starts"] == STAGE_STARTS[case.model], "the partitioner cut elsewhere"
    oracle = _oracle_of(case)
    expected = _oracle_run(case, result, oracle)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected.losses), rtol=RTOL, atol=0)
    assert set(result["state"]) == set(expected.state)
    for key, value in expected.state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
    # the check has teeth: another rule gives other weights (2BW's updates read without their batch of delay;
    # the others' read once per batch), and so does clipping left out
    others = [dataclasses.replace(oracle, batches_late=0) if oracle.kind == "2bw" else
              dataclasses.replace(oracle, kind="2bw")]
    if oracle.max_grad_norm is not None:
        others.append(dataclasses.replace(oracle, max_grad_norm=None))
    for other in others:
        wrong = _oracle_run(case, result, other)
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
    assert [two.update_of(i) for i in range(2 * m)] == [0] * m + [1] * m  # whole updates, ints


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


@pytest.mark.parametrize("p", [2, 3])
def test_after_a_drain_the_stream_fills_the_pipeline_again(p):
    """A flush drains every rank; the next batches (global numbers go on) start with 1F1B's warmup again."""
    m = 2
    again = pipedream(num_ranks=p, num_microbatches=m, num_batches=2)
    for rank in range(p):
        cursor = stream_segment(rank=rank, num_ranks=p, next_forward=0, next_backward=0, end=m - 1)[1]
        cursor = stream_segment(rank=rank, num_ranks=p, next_forward=cursor[0], next_backward=cursor[1], end=None)[1]
        assert cursor == (m, m)
        actions = []
        for end in (2 * m - 1, 3 * m - 1, None):
            part, cursor = stream_segment(rank=rank, num_ranks=p, next_forward=cursor[0], next_backward=cursor[1],
                                          end=end)
            actions += part
        assert [str(a) for a in actions] == [str(dataclasses.replace(a, microbatch=a.microbatch + m))
                                             for a in again.actions[rank]]


def test_pipemare_built_without_options_carries_the_documented_defaults():
    rule = pipemare(num_ranks=2, num_microbatches=2).staleness
    assert (rule.lr_warmup_updates, rule.correction_decay) == (
        PIPEMARE_DEFAULTS["pipemare_lr_warmup_updates"], PIPEMARE_DEFAULTS["pipemare_correction_decay"])


def test_simulated_weight_versions():
    costs = StageCosts(forward=1, backward=1, weight=0)
    assert simulate(pipedream(num_ranks=4, num_microbatches=4, num_batches=4), costs=costs
                    ).weight_versions_per_rank == (4, 3, 2, 1)
    assert simulate(pipedream_2bw(num_ranks=4, num_microbatches=4, num_batches=4), costs=costs).weight_versions == 2
    assert simulate(pipemare(num_ranks=4, num_microbatches=4, num_batches=4), costs=costs).weight_versions == 1
    # one fill and one drain for the whole stream: 2 (p - 1) idle slots per rank in 2N + 2 (p - 1)
    long = simulate(pipedream(num_ranks=4, num_microbatches=8, num_batches=64), costs=costs)
    assert long.mean_bubble == pytest.approx(6 / (2 * 512 + 6))


def test_pipemare_rescales_the_rate_by_delay_then_releases_it():
    rule = StalenessRule(kind="pipemare", num_stages=4, lr_warmup_updates=10, correction_decay=0.5)
    assert rule.lr_scale(0, 0) == pytest.approx(1 / 3) and rule.lr_scale(3, 0) == 1.0
    assert rule.lr_scale(0, 5) == pytest.approx(3 ** -0.5) and rule.lr_scale(0, 10) == 1.0
    assert rule.lr_scale(0, 25) == 1.0  # past the warm-up the full rate, never more
    assert dataclasses.replace(rule, lr_warmup_updates=0).lr_scale(0, 0) == 1.0


# -- the oracle against traces computed by hand ------------------------------------------------------
# Two stages (stage 0: h = tanh(w0 x); stage 1: out = w1 h; loss (out - y)^2), two batches of two
# microbatches, plain SGD. Which version (weights after that many updates) each microbatch's F and B read
# on each stage, written out from the papers: PipeDream updates after every microbatch and stage 0 runs
# one forward ahead, so its F and B (stashed) read one update behind stage 1. 2BW updates once per batch
# with its mean gradient, one batch late: batches 0 and 1 both read W(0). PipeMare's F reads PipeDream's
# version, its B the newest, corrected back by lag (B - F) times delta, the running average of the
# stage's steps (decay 1/2); the gradient of stage 0 is taken at its forward input with those weights.
HAND_VERSIONS = {  # kind: ((stage 0 F, stage 0 B), (stage 1 F, stage 1 B)), microbatches 0..3
    "pipedream": (([0, 0, 1, 2], [0, 0, 1, 2]), ([0, 1, 2, 3], [0, 1, 2, 3])),
    "2bw": (([0, 0, 0, 0], [0, 0, 0, 0]), ([0, 0, 0, 0], [0, 0, 0, 0])),
    "pipemare": (([0, 0, 1, 2], [0, 1, 2, 3]), ([0, 1, 2, 3], [0, 1, 2, 3])),
}
HAND_UPDATES_AFTER = {"pipedream": [0, 1, 2, 3], "2bw": [1, 3], "pipemare": [0, 1, 2, 3]}  # closing microbatches


def _hand_trace(kind: str, microbatches, *, lr: float, max_norm=None, versions=None, correction: float = 1.0):
    """Scalar arithmetic, no autograd, no torch: (each microbatch's loss, the final (w0, w1))."""
    (f0, b0), (f1, b1) = versions or HAND_VERSIONS[kind]
    weights, delta, grads, losses = [(0.5, -0.75)], [0.0, 0.0], [], []
    for i, (x, y) in enumerate(microbatches):
        h = math.tanh(weights[f0[i]][0] * x)  # stage 0's forward: the input stage 1 records
        losses.append((weights[f1[i]][1] * h - y) ** 2)
        a = weights[b0[i]][0] - correction * (b0[i] - f0[i]) * delta[0]  # backward weights, corrected
        b = weights[b1[i]][1] - correction * (b1[i] - f1[i]) * delta[1]
        d = 2 * (b * h - y)  # d loss / d out, stage 1 recomputed on its recorded input h
        grads.append((d * b * (1 - math.tanh(a * x) ** 2) * x, d * h))
        if i in HAND_UPDATES_AFTER[kind]:
            n = 2 if kind == "2bw" else 1
            g0, g1 = (sum(g[k] for g in grads[-n:]) / n for k in (0, 1))
            if max_norm is not None:  # torch's clip_grad_norm_: both stages' gradients of this update together
                coef = min(1.0, max_norm / (math.hypot(g0, g1) + 1e-6))
                g0, g1 = g0 * coef, g1 * coef
            old = weights[-1]
            new = (old[0] - lr * g0, old[1] - lr * g1)
            if kind == "pipemare":
                delta = [0.5 * dl + 0.5 * (n_ - o_) for dl, n_, o_ in zip(delta, new, old)]
            weights.append(new)
    return losses, weights[-1]


@pytest.mark.parametrize(("kind", "max_norm"), [("pipedream", None), ("2bw", None), ("pipemare", None), ("2bw", 0.05)],
                         ids=["pipedream", "2bw", "pipemare", "2bw-clipped"])
def test_oracle_follows_a_hand_computed_trace_at_p2_m2(kind, max_norm):
    """The oracle the distributed runtime is judged by gives the losses and weights of the trace above."""
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Tanh(), torch.nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[2].weight.fill_(-0.75)
    xs, ys = [[1.0, 2.0], [-1.0, 0.5]], [[0.3, -0.2], [0.1, 0.4]]
    batches = [((torch.tensor(x).view(2, 1),), torch.tensor(y).view(2, 1)) for x, y in zip(xs, ys)]
    oracle = Oracle(kind=kind, num_stages=2, num_microbatches=2, stage_starts=("2",), correction_decay=0.5,
                    max_grad_norm=max_norm)
    got = run_oracle(model, oracle, batches=batches, loss_fn=torch.nn.functional.mse_loss,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    flat = [(x, y) for bx, by in zip(xs, ys) for x, y in zip(bx, by)]
    losses, (w0, w1) = _hand_trace(kind, flat, lr=0.1, max_norm=max_norm)
    assert got.losses == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-6)
    assert got.state["0.weight"].item() == pytest.approx(w0, rel=1e-6)  # fp32 against float64 arithmetic
    assert got.state["2.weight"].item() == pytest.approx(w1, rel=1e-6)
    # the trace has teeth: read at the newest weights (no staleness) it ends elsewhere; PipeMare's correction
    # with the other sign too; and clipping is active at this bound
    newest = [0, 1, 2, 3] if kind != "2bw" else [0, 0, 1, 1]
    elsewhere = [_hand_trace(kind, flat, lr=0.1, max_norm=max_norm, versions=((newest, newest), (newest, newest)))]
    if kind == "pipemare":
        elsewhere.append(_hand_trace(kind, flat, lr=0.1, max_norm=max_norm, correction=-1.0))
    if max_norm is not None:
        elsewhere.append(_hand_trace(kind, flat, lr=0.1))
    for _, (v0, v1) in elsewhere:  # 10x the tolerance the oracle is held to above
        assert max(abs(v0 - w0) / abs(w0), abs(v1 - w1) / abs(w1)) > 1e-5


@pytest.mark.parametrize("schedule", ["pipedream", "pipemare"])
def test_clipping_under_an_update_per_microbatch_is_refused(schedule, one_rank_mesh):
    """The last stage would wait for stage 0's backward across the step's loss exchange: a PlanError that
    says so and names 2BW, never a hang (docs/schedules.md, "Gradient clipping")."""
    import autopar
    model = build_model("llama_tiny", num_layers=1, seq_len=8)
    x = torch.randint(0, 128, (2, 8))
    with pytest.raises(autopar.PlanError, match="cannot be applied exactly") as info:
        autopar.compile(model, one_rank_mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                        schedule=schedule, num_microbatches=2, max_grad_norm=1.0)
    assert "pipedream_2bw" in str(info.value)


def test_oracle_of_one_stage_is_plain_per_microbatch_training():
    torch.manual_seed(0)
    model = build_model("gpt_tiny", num_layers=1, seq_len=8)
    x = torch.randint(0, 128, (4, 8))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    got = run_oracle(model, Oracle(kind="pipedream", num_stages=1, num_microbatches=2, stage_starts=()),
                     batches=[((x,), x), ((x,), x)], loss_fn=lm_loss, optimizer=sgd)
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


@pytest.mark.parametrize("bad", [dict(kind="pipedream", num_stages=0), dict(kind="2bw", num_stages=2, updates_every=0),
                                 dict(kind="pipemare", num_stages=2, lr_warmup_updates=-1),
                                 dict(kind="pipemare", num_stages=2, correction_decay=1.0),
                                 dict(kind="pipemare", num_stages=2, correction_decay=-0.5),
                                 dict(kind="pipemare", num_stages=2, correction_decay=1.5)],
                         ids=["no-stages", "no-microbatch-per-update", "negative-warmup", "decay-1", "decay-negative",
                              "decay-above-1"])
def test_a_rule_out_of_range_is_a_schedule_error(bad):
    from autopar.errors import ScheduleError
    with pytest.raises(ScheduleError):
        StalenessRule(**bad)


def test_a_rule_is_frozen_keyword_data_whose_pipemare_has_no_warmup_by_default():
    rule = StalenessRule(kind="pipemare", num_stages=4)
    assert rule.lr_scale(0, 0) == 1.0  # lr_warmup_updates defaults to 0: the full rate from the start
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.num_stages = 2
    with pytest.raises(TypeError):
        StalenessRule("pipedream", 2)


def test_an_asynchronous_program_refuses_a_partial_batch_with_its_shapes():
    """A batch cut into fewer microbatches than compiled is autopar's PlanError naming the count and the first
    microbatch's shapes (its message once read an undefined name: a NameError instead)."""
    from types import SimpleNamespace

    import autopar
    from autopar.runtime.execution.program_surface import ProgramSurface
    stages = object()
    microbatch = {"idx": torch.zeros(2, 16, dtype=torch.long), "target": torch.zeros(2, 16, dtype=torch.long)}
    program = SimpleNamespace(stages=stages, info=SimpleNamespace(rank=1),
                              batching=SimpleNamespace(count=4, cut=lambda tensors: ([microbatch] * 3, [stages] * 3)))
    with pytest.raises(autopar.PlanError) as info:
        ProgramSurface._microbatches(program, ())
    assert "makes 3 microbatches (of 4), the first shaped {'idx': (2, 16), 'target': (2, 16)}" in info.value.what
    assert info.value.where == "rank 1, train_step" and "drop_last=True" in info.value.fix
