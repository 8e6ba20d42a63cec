"""``program.optimizer`` as a torch optimizer, without a process group: parameter groups by name, torch's and
transformers' schedulers on it, its state_dict, and the errors a loop can meet (runtime/state/zero.py,
runtime/state/param_groups.py). The spawned loops that judge it on meshes are in tests/runtime/test_training_loop.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.optim import lr_scheduler

import autopar
from autopar.runtime.checkpoints.checkpoint_extra import check_extra
from autopar.runtime.state.param_groups import group_template
from autopar.runtime.execution.rank_context import AxisGroup
from autopar.runtime.execution.step_report import batch_counts
from autopar.runtime.state.zero import ShardedOptimizer

ONE_RANK = AxisGroup(group=None, ranks=(0,), index=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 10))


def _adamw_groups(named):
    """Trainer's rule: no decay on biases and norm weights (module 1 is the LayerNorm)."""
    named = list(named)
    no_decay = [p for n, p in named if n.endswith("bias") or n.startswith("1.")]
    decay = [p for n, p in named if not (n.endswith("bias") or n.startswith("1."))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=0.01, betas=(0.9, 0.95))


def _wrapped(model, factory=_adamw_groups, **kw) -> ShardedOptimizer:
    template = group_template(factory, model.named_parameters(), named=True)
    return ShardedOptimizer(list(model.named_parameters()), factory, zero_stage=0, dp=ONE_RANK, template=template,
                            **kw)


def _scheduler(opt, index: int):
    """Scheduler ``index`` on ``opt`` (only that one: a scheduler sets the groups when it is built)."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup
    return [lambda: lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step),
            lambda: lr_scheduler.CosineAnnealingLR(opt, T_max=4),
            lambda: lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8),  # cycles the betas too
            lambda: lr_scheduler.SequentialLR(opt, [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
                                                    lr_scheduler.ExponentialLR(opt, gamma=0.8)], milestones=[2]),
            lambda: get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8),
            lambda: get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)][index]()


@pytest.mark.parametrize("index", range(6))
def test_schedulers_drive_the_wrapper_as_they_drive_torchs_optimizer(index):
    """The same scheduler on program.optimizer and on the plain AdamW of a copy, the same gradients: the
    same learning rates and betas every step, the same weights bitwise, the inner optimizer's groups
    holding the wrapper's settings."""
    model = _model()
    twin = copy.deepcopy(model)
    opt, plain = _wrapped(model), _adamw_groups(twin.named_parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    sched, plain_sched = _scheduler(opt, index), _scheduler(plain, index)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        with opt.stepping():
            opt.step()
        plain.step()
        stepped_with = [(g["lr"], g["betas"], g["weight_decay"]) for g in plain.param_groups]
        assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.optimizer.param_groups] == stepped_with
        sched.step()
        plain_sched.step()
        assert [(g["lr"], g["betas"]) for g in opt.param_groups] == [(g["lr"], g["betas"]) for g in plain.param_groups]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_groups_are_decided_by_name_on_the_whole_models_shapes():
    """The factory sees stand-ins of the full shapes (a shape rule picks as on one device), tied weights once;
    a rank's tensors (here flat 1-D shards, as ZeRO-3 holds them) join the group of their name."""
    model = _model()
    model[3].weight = model[0].weight = nn.Parameter(torch.randn(10, 6))  # tied: "0.weight" and "3.weight"
    by_shape = lambda params: torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2]},  # noqa: E731
                                               {"params": [p for p in params if p.dim() < 2], "lr": 0.0}], lr=0.1)
    template = group_template(by_shape, model.named_parameters(), named=False)
    assert "3.weight" not in template.names  # named_parameters() gives a tied weight once
    assert template.group_of("3.weight", ("0.weight", "3.weight")) == 0
    assert template.group_of("1.weight") == 1
    shards = [(n, nn.Parameter(p.detach().reshape(-1)[:3].clone())) for n, p in model.named_parameters()]
    shards.append(("3.weight", shards[0][1]))  # the graphs' name of the tied weight (aliases below)
    opt = ShardedOptimizer(shards[1:], by_shape, zero_stage=3, dp=ONE_RANK, template=template,
                           aliases={"3.weight": ("0.weight", "3.weight")})
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]  # 3.weight and 2.weight; the 1-D rest
    assert opt.param_groups[1]["lr"] == 0.0 and opt.optimizer.param_groups[1]["lr"] == 0.0


def test_a_tied_weight_whose_names_are_in_two_groups_is_refused():
    model = _model()
    template = group_template(_adamw_groups, model.named_parameters(), named=True)
    with pytest.raises(autopar.PlanError, match="different parameter groups"):
        template.group_of("2.weight", ("2.weight", "2.bias"))


def test_a_parameter_in_no_group_is_not_stepped():
    model = _model()
    only_linear = lambda named: torch.optim.SGD([p for n, p in named if n.startswith("2.")], lr=0.1)  # noqa: E731
    opt = _wrapped(model, only_linear)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with opt.stepping():
        opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"2.weight", "2.bias"} and opt.stepped_names() == ["2.weight", "2.bias"]


@pytest.mark.parametrize("factory, named, match", [
    (lambda named: torch.optim.SGD(_model().parameters(), lr=0.1), True, "not given"),  # its own model's
    # a factory of pairs without optimizer_params="named": it says what it was given
    (lambda named: torch.optim.SGD([p for _, p in named], lr=0.1), False, "raised ValueError.*optimizer_params"),
    (lambda named: object(), True, "no param_groups"),
])
def test_factories_that_cannot_work_are_plan_errors(factory, named, match):
    with pytest.raises(autopar.PlanError, match=match):
        group_template(factory, _model().named_parameters(), named=named)


def test_stepping_by_hand_is_refused():
    """train_step steps the optimizer: a loop's own optimizer.step() would apply the gradients twice."""
    opt = _wrapped(_model())
    with pytest.raises(autopar.PlanError, match="train_step already steps"):
        opt.step()


def test_state_dict_round_trip_restores_state_and_settings():
    model = _model()
    opt = _wrapped(model)
    sched = lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for _ in range(2):
        with opt.stepping():
            opt.step()
        sched.step()
    saved = opt.state_dict()
    fresh = _wrapped(copy.deepcopy(model))
    fresh.load_state_dict(saved)
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups] == [0.0025, 0.0025]
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [0.0025, 0.0025]  # applied to the inner one
    assert fresh.optimizer.state is fresh.state and len(fresh.state) == len(list(model.parameters()))
    mine = {i: s["exp_avg"] for i, s in saved["state"].items()}
    assert all(torch.equal(fresh.state_dict()["state"][i]["exp_avg"], v) for i, v in mine.items())


def test_extra_objects_must_be_stateful():
    with pytest.raises(autopar.CheckpointError, match="lacks state_dict"):
        check_extra({"scheduler": 3}, where="save_checkpoint(extra=...)")
    with pytest.raises(autopar.CheckpointError, match="mapping"):
        check_extra([1], where="save_checkpoint(extra=...)")
    opt = _wrapped(_model())
    assert check_extra({"s": lr_scheduler.LambdaLR(opt, lambda s: 1.0)}, where="x").keys() == {"s"}


def test_batch_counts_read_token_ids_from_the_shapes():
    ids, mask = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.bool)
    assert batch_counts((ids, mask), dp=2) == (8, 128)
    assert batch_counts((torch.randn(4, 3, 8, 8),), dp=1) == (4, None)  # images: samples only


def test_groups_cannot_be_added_after_compile():
    opt = _wrapped(_model())
    with pytest.raises(autopar.PlanError, match="cannot take new parameter groups"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


# -- a compiled program on a one-rank gloo group in this process -----------------------------------------
def _gpt_batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
            for _ in range(n)]


def _gpt_program(mesh, factory=_adamw_groups, **options):
    from autopar.models import build_model, lm_loss
    torch.manual_seed(0)
    x, y = _gpt_batches(1)[0]
    return autopar.compile(build_model("gpt_tiny"), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                           optimizer=factory, optimizer_params="named", **options)


def _gpt_groups(named):
    named = list(named)
    no_decay = [p for n, p in named if n.endswith("bias") or "ln" in n]
    decay = [p for n, p in named if not (n.endswith("bias") or "ln" in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=0.01)


def test_a_resumed_program_goes_on_with_its_schedule(one_rank_mesh, tmp_path):
    """One rank: the scheduler saved with the checkpoint (extra=) and the groups' lrs come back; the report of
    each step (lr used, gradient norm as torch computes it, tokens) is right."""
    from autopar.models import build_model, lm_loss
    data = _gpt_batches()
    program = _gpt_program(one_rank_mesh, _gpt_groups)
    sched = lr_scheduler.LambdaLR(program.optimizer, lambda s: (s + 1) / 4)
    torch.manual_seed(0)
    model = build_model("gpt_tiny")
    ref = _gpt_groups(model.named_parameters())
    ref_sched = lr_scheduler.LambdaLR(ref, lambda s: (s + 1) / 4)
    reports, expected = [], []
    for k, (x, y) in enumerate(data):
        if k == 2:
            program.save_checkpoint(str(tmp_path / "ck"), extra={"scheduler": sched})
            program = _gpt_program(one_rank_mesh, _gpt_groups)
            sched = lr_scheduler.LambdaLR(program.optimizer, lambda s: (s + 1) / 4)  # lr of step 0 again
            assert program.load_checkpoint(str(tmp_path / "ck"), extra={"scheduler": sched}) == 2
        program.train_step(x, target=y)
        reports.append(program.last_step)
        sched.step()
        ref.zero_grad()
        lm_loss(model(x), y).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        expected.append(([g["lr"] for g in ref.param_groups], norm.item()))
        ref.step()
        ref_sched.step()
    assert [list(r.lrs) for r in reports] == [lrs for lrs, _ in expected]
    torch.testing.assert_close(torch.tensor([r.grad_norm for r in reports]), torch.tensor([n for _, n in expected]),
                               rtol=1e-5, atol=0)
    assert [r.step for r in reports] == [1, 2, 3, 4] and {(r.num_samples, r.num_tokens) for r in reports} == {(4, 64)}
    assert all(r.seconds > 0 and r.tokens_per_s == 64 / r.seconds for r in reports)


def test_a_checkpoint_without_an_extra_state_asked_for_changes_nothing(one_rank_mesh, tmp_path):
    program = _gpt_program(one_rank_mesh, _gpt_groups)
    x, y = _gpt_batches(1)[0]
    program.train_step(x, target=y)
    program.save_checkpoint(str(tmp_path / "ck"))
    fresh = _gpt_program(one_rank_mesh, _gpt_groups)
    before = fresh.full_state_dict()
    sched = lr_scheduler.LambdaLR(fresh.optimizer, lambda s: 1.0)
    with pytest.raises(autopar.CheckpointError, match=r"holds no state for \['scheduler'\]"):
        fresh.load_checkpoint(str(tmp_path / "ck"), extra={"scheduler": sched})
    assert fresh.step_count == 0 and all(torch.equal(v, fresh.full_state_dict()[k]) for k, v in before.items())


def test_a_checkpoint_of_other_parameter_groups_is_refused(one_rank_mesh, tmp_path):
    program = _gpt_program(one_rank_mesh, _gpt_groups)
    program.save_checkpoint(str(tmp_path / "ck"))
    one_group = _gpt_program(one_rank_mesh, lambda named: torch.optim.AdamW([p for _, p in named], lr=0.01))
    with pytest.raises(autopar.CheckpointError, match="2 parameter group"):
        one_group.load_checkpoint(str(tmp_path / "ck"))


def test_a_factory_over_the_models_own_parameters_is_refused_at_compile(one_rank_mesh):
    from autopar.models import build_model
    other = build_model("gpt_tiny")
    with pytest.raises(autopar.PlanError, match="that the factory was not given"):
        _gpt_program(one_rank_mesh, lambda named: torch.optim.AdamW(other.parameters(), lr=0.01))


def test_the_programs_optimizer_is_not_stepped_by_hand(one_rank_mesh):
    program = _gpt_program(one_rank_mesh, _gpt_groups)
    x, y = _gpt_batches(1)[0]
    program.train_step(x, target=y)
    with pytest.raises(autopar.PlanError, match="train_step already steps"):
        program.optimizer.step()
