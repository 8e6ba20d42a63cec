"""Runner kinds for the training-loop tests (tests/runtime/test_training_loop.py): a loop as users write it.

The loop: AdamW with parameter groups chosen by name as transformers' Trainer chooses them (weight
decay off biases and norm weights: ``transformers.trainer_pt_utils.get_parameter_names`` with the
Trainer's patterns), optionally the embeddings in a third group of their own learning rate, and
transformers' ``get_cosine_schedule_with_warmup`` stepped after every step. :func:`reference_loop` runs it
on one device on the model itself; :func:`loop` under autopar (``optimizer_params="named"``), reading
``program.last_step`` after each step; :func:`save` and :func:`resume` stop it after ``save_after`` steps
and go on from the checkpoint (the scheduler in ``extra``) on another mesh. ``case.extra`` holds the
runner's settings: ``groups`` ("trainer" or "embeddings"), ``warmup``, ``save_after``, ``name``.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tempfile

import torch
import torch.nn as nn

from equivalence import Case, batches, build, replica_record, run_cases, scrambled

ROOT_ENV = "AUTOPAR_TEST_LOOP_CKPT"
# transformers.Trainer.get_decay_parameter_names: no decay in LayerNorms, nor on these names
TRAINER_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def decay_names(model: nn.Module) -> set[str]:
    """The names transformers' Trainer decays (its get_decay_parameter_names)."""
    from transformers.trainer_pt_utils import get_parameter_names
    return set(get_parameter_names(model, [nn.LayerNorm], TRAINER_NO_DECAY))


def group_factory(model: nn.Module, case: Case):
    """A factory of ``(name, parameter)`` pairs -> AdamW over the Trainer's groups (and the embeddings' own)."""
    decay, embeddings = decay_names(model), dict(case.extra).get("groups") == "embeddings"

    def make(named):
        named = [(n, p) for n, p in named if p.requires_grad]
        emb = [(n, p) for n, p in named if embeddings and "emb" in n]
        rest = [(n, p) for n, p in named if not (embeddings and "emb" in n)]
        groups = [{"params": [p for n, p in rest if n in decay], "weight_decay": 0.1},
                  {"params": [p for n, p in rest if n not in decay], "weight_decay": 0.0}]
        if embeddings:  # last: a tensor put in group 0 by mistake would get another lr and decay
            groups.append({"params": [p for _, p in emb], "weight_decay": 0.0, "lr": case.lr / 2})
        return torch.optim.AdamW(groups, lr=case.lr, betas=(0.9, 0.95), eps=1e-5)
    return make


def scheduler_for(optimizer, case: Case):
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=dict(case.extra).get("warmup", 4),
                                           num_training_steps=case.steps)


MOE = ("switch", "deepseek")  # autopar.models.moe, through tests/moe_runners.py


def _build(case: Case):
    if case.model in MOE:
        from moe_runners import build as build_moe
        return build_moe(case)
    return build(case)


def _loss_fn(case: Case):
    if case.model in MOE:
        from autopar.models.moe import moe_loss
        return moe_loss
    from autopar.models import lm_loss
    return lm_loss


def _data(case: Case, model) -> list:
    if case.model in MOE:
        from moe_runners import batches as moe_batches
        return moe_batches(case)
    return batches(case, model.cfg.vocab_size)


def reference_loop(case: Case) -> dict:
    """The loop on one device: per step the loss, the groups' lrs, the gradient norm; the final weights."""
    model = _build(case)
    optimizer = group_factory(model, case)(list(model.named_parameters()))
    scheduler = scheduler_for(optimizer, case)
    max_norm = dict(case.options).get("max_grad_norm")
    out = {"losses": [], "lrs": [], "grad_norms": []}
    for x, y in _data(case, model):
        optimizer.zero_grad()
        loss = _loss_fn(case)(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
        out["lrs"].append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
        out["losses"].append(loss.item())
        out["grad_norms"].append(norm.item())
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _compile(case: Case, mesh, model):
    import autopar
    data = _data(case, model)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=_loss_fn(case),
                              example_target=data[0][1], optimizer=group_factory(model, case),
                              optimizer_params="named", p2p_timeout_s=120, **dict(case.options))
    return program, scheduler_for(program.optimizer, case), data


def _train(program, scheduler, data) -> dict:
    out = {"losses": [], "lrs": [], "grad_norms": [], "samples": [], "tokens": []}
    for x, y in data:
        loss = program.train_step(program.shard_batch(x), target=program.shard_batch(y))
        report = program.last_step
        scheduler.step()
        out["losses"].append(loss.item())
        out["lrs"].append(list(report.lrs))
        out["grad_norms"].append(report.grad_norm)
        out["samples"].append(report.num_samples)
        out["tokens"].append(report.num_tokens)
    return out


def _groups_record(program) -> dict:
    """Every inner group's settings next to the wrapper group it stands for (they must agree after a step)."""
    opt = program.optimizer
    inner = opt.optimizer.param_groups if opt.optimizer is not None else []
    return {"wrapper": [{k: v for k, v in g.items() if k in ("lr", "weight_decay", "betas")} for g in opt.param_groups],
            "inner": [(k, {key: g[key] for key in ("lr", "weight_decay", "betas")})
                      for k, g in zip(opt.groups_here, inner)]}


def _replicas(program) -> dict:
    """The replica record; under expert parallelism keyed as tests/moe_runners.py keys it (dp ranks holding the
    same experts agree)."""
    record = replica_record(program)
    ep = program.plan.expert_parallel
    if ep > 1:
        coords = dict(record["coords"])
        record["coords"] = {"dp": coords["dp"] // ep, "pp": coords["pp"], "tp": (coords["tp"], coords["dp"] % ep)}
    return record


def loop(case: Case, mesh) -> dict:
    """The loop under autopar on ``mesh``: what :func:`reference_loop` returns, from ``program.last_step``."""
    program, scheduler, data = _compile(case, mesh, _build(case))
    out = _train(program, scheduler, data)
    out.update(state=program.full_state_dict(), groups=_groups_record(program), **_replicas(program))
    return out


def _root(case: Case) -> str:
    return os.path.join(os.environ[ROOT_ENV], dict(case.extra)["name"])


def save(case: Case, mesh) -> dict:
    """The first ``save_after`` steps, then a checkpoint carrying the scheduler."""
    program, scheduler, data = _compile(case, mesh, _build(case))
    out = _train(program, scheduler, data[:dict(case.extra)["save_after"]])
    out["folder"] = program.save_checkpoint(_root(case), extra={"scheduler": scheduler})
    return out


def resume(case: Case, mesh) -> dict:
    """Other weights and a fresh scheduler, the checkpoint loaded (the scheduler with it), the remaining steps."""
    program, scheduler, data = _compile(case, mesh, scrambled(_build(case)))
    step = program.load_checkpoint(_root(case), extra={"scheduler": scheduler})
    out = _train(program, scheduler, data[step:])
    out.update(step=step, state=program.full_state_dict(), **replica_record(program))
    return out


def batch_lr_factor(batch: int) -> float:
    """The asynchronous cases' schedule: a ``LambdaLR`` factor per batch, up and down."""
    return (1.0, 0.25, 2.0, 0.5, 1.5, 0.75)[batch]


def async_loop(case: Case, mesh) -> dict:
    """An asynchronous schedule with ``LambdaLR(batch_lr_factor)`` stepped after every ``train_step``: what the
    oracle (tests/async_oracle.py, ``lr_lambda=``) needs to replay it."""
    from schedule_runners import _compile as compile_async, layout_of, text_batches
    data = text_batches(case)
    program = compile_async(case, mesh, data)
    scheduler = torch.optim.lr_scheduler.LambdaLR(program.optimizer, batch_lr_factor)
    losses, lrs = [], []
    for x, y in data:
        losses.append(program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item())
        lrs.append(list(program.last_step.lrs))
        scheduler.step()
    return {"losses": losses, "lrs": lrs, "state": program.full_state_dict(), "data": data,
            "layout": layout_of(program), "rule": program.rule, "num_microbatches": program.plan.pipeline.num_microbatches,
            **replica_record(program)}


# -- the spawned cases of tests/runtime/test_training_loop.py, one group per world (and one that loads) ----
STEPS, SAVE_AFTER, CLIP = 20, 10, 0.5  # CLIP: under every step's gradient norm of the gpt_tiny loop


def _loop(mesh, model="gpt_tiny", groups="embeddings", kind="loop", **options) -> Case:
    return Case(model=model, mesh=mesh, kind=f"loop_runners:{kind}", steps=STEPS, lr=0.01, optimizer="adamw",
                options=tuple(options.items()), extra=(("groups", groups),))


def _stop(case: Case, kind: str, name: str) -> Case:
    extra = case.extra + (("name", name),) + ((("save_after", SAVE_AFTER),) if kind == "save" else ())
    return dataclasses.replace(case, kind=f"loop_runners:{kind}", extra=extra)


#: the loop on dp=2 under each ZeRO stage (ZeRO-2 clipping), on transformers' Qwen2 (Trainer's two groups), and
#: with experts split over ep; then bf16 masters under ZeRO-1 and ZeRO-0 (bitwise alike)
LOOPS = [_loop((2, 1, 1), zero_stage=0), _loop((2, 1, 1), zero_stage=1),
         _loop((2, 1, 1), zero_stage=2, max_grad_norm=CLIP), _loop((2, 1, 1), zero_stage=3),
         _loop((1, 1, 2), model="hf_qwen2", groups="trainer"),
         _loop((2, 1, 1), model="hf_qwen2", groups="trainer", zero_stage=3),
         _loop((2, 1, 1), model="switch", groups="trainer", expert_parallel=2, zero_stage=1, num_microbatches=1),
         _loop((1, 2, 2)), _loop((2, 2, 1), schedule="1f1b"), _loop((1, 2, 2), model="hf_qwen2", groups="trainer")]
BF16 = [_loop((2, 1, 1), zero_stage=1, precision="bf16"), _loop((2, 1, 1), zero_stage=0, precision="bf16")]
#: saved after SAVE_AFTER steps, resumed on dp=2: from tp=2 (default suite) and from pp=2 x tp=2 (slow)
SAVES = {"T": _stop(_loop((1, 1, 2)), "save", "T"), "A": _stop(_loop((1, 2, 2)), "save", "A")}
RESUMES = {name: _stop(_loop((2, 1, 1)), "resume", name) for name in SAVES}
#: a LambdaLR per batch under each asynchronous schedule (SGD with momentum, as tests/schedule_runners.py)
ASYNC = [Case(model=m, mesh=(1, 2, 1), kind="loop_runners:async_loop", steps=5,
              options=(("schedule", s), ("num_microbatches", 2)) + extra)
         for m, s, extra in [("llama_tiny", "pipedream", ()), ("gpt_tiny", "pipedream_2bw", ()),
                             ("llama_tiny", "pipemare", (("pipemare_lr_warmup_updates", 4),))]]

GROUPS = {"two": [c for c in LOOPS + BF16 if c.world_size == 2] + [SAVES["T"], RESUMES["T"]] + ASYNC,
          "four": [c for c in LOOPS if c.world_size == 4] + [SAVES["A"]],
          "two_from_four": [RESUMES["A"]]}
_AFTER = {"two_from_four": "four"}
_GROUP_OF = {id(case): name for name, cases in GROUPS.items() for case in cases}


def is_slow(case: Case) -> bool:
    return _GROUP_OF[id(case)] != "two"


@functools.lru_cache(maxsize=None)
def _checkpoint_root() -> str:
    root = tempfile.mkdtemp(prefix="autopar-loop-")
    atexit.register(shutil.rmtree, root, True)
    os.environ[ROOT_ENV] = root  # the spawned workers inherit it
    return root


@functools.lru_cache(maxsize=None)
def _results(group: str) -> tuple:
    _checkpoint_root()
    if group in _AFTER:
        _results(_AFTER[group])
    return tuple(run_cases(GROUPS[group]))


def result(case: Case) -> dict:
    """Rank 0's result of ``case`` (every rank judged: equivalence.judge_ranks), from its group's one run."""
    group = _GROUP_OF[id(case)]
    return _results(group)[[id(c) for c in GROUPS[group]].index(id(case))]
