"""A single-process emulation of the asynchronous schedules' staleness rules, on the unsplit model.

It is the reference the distributed runtime (:mod:`autopar.runtime.async_pipeline`) is tested
against: plain torch, one process, no pipeline. Microbatches run one after another, each
through the whole model, with every stage's weights taken at the version the rule names; each
update is applied as soon as its gradient is complete (the runtime applies it lazily, later, to
the same effect). All versions are kept, so nothing depends on stashing bookkeeping.

- PipeDream and 2BW: one forward and backward of the whole model with each parameter at its
  stage's version ``rule.forward_version(stage, i)``.
- PipeMare: a forward at the forward versions (the loss reported, and every stage's input
  recorded at the stage boundaries), then a second pass with each stage at its corrected backward
  weights ``w_{v_b} - (v_b - v_f) * delta`` whose stage inputs are replaced by the recorded ones
  (gradients pass through to the stage before): the gradient of each stage function at its
  forward input and backward weights, as the runtime's recompute computes it.
A sketch (tests/runtime/test_async_pipeline.py runs it against the runtime)::

    result = emulate(model, rule=StalenessRule(kind="2bw", num_stages=2, updates_every=4),
                     layout=stage_layout(autopar.plan(...)), batches=[(x, y), ...], ...)
    result.losses[-1] < result.losses[0]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from autopar.errors import PlanError
from autopar.passes.graph_names import user_name
from autopar.runtime.schedules.staleness import StalenessRule
from autopar.runtime.weight_versions import corrected_weights, update_velocity

__all__ = ["StageLayout", "stage_layout", "EmulationResult", "emulate"]


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where the model is cut: the stages holding each parameter and the module each later stage starts at."""

    param_stages: Mapping[str, tuple[int, ...]]  # user parameter name -> stages that read it
    stage_starts: tuple[str, ...]  # module path where stage 1, 2, ... begins


def stage_layout(plan_result) -> StageLayout:
    """The layout of an :func:`autopar.plan` result (its tp rank 0 graphs)."""
    stages: dict[str, set[int]] = {}
    for stage in plan_result.lowered[0].stages:
        for target in stage.param_names:
            stages.setdefault(user_name(target), set()).add(stage.stage)
    return StageLayout({k: tuple(sorted(v)) for k, v in stages.items()}, tuple(plan_result.plan.pipeline.stage_starts))


@dataclasses.dataclass
class EmulationResult:
    """The mean loss of each batch and the weights after the last update."""

    losses: list[float]
    state: dict[str, torch.Tensor]


class _Substitute(torch.autograd.Function):
    """Forward: the recorded stage input. Backward: the gradient goes on to the stage before."""

    @staticmethod
    def forward(ctx, x, recorded):
        return recorded.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Emulator:
    """The per-stage state of one emulated stream."""

    def __init__(self, model: nn.Module, *, rule: StalenessRule, layout: StageLayout, optimizer: Callable):
        self.model, self.rule = model, rule
        self.names = [n for n, _ in model.named_parameters()]  # tied weights appear once
        aliases = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self.stage = {}
        for name, p in model.named_parameters():
            stages = sorted({s for a in aliases[id(p)] for s in layout.param_stages.get(a, ())})
            if len(stages) > 1 and rule.kind != "2bw":
                raise PlanError(f"{rule.kind} cannot emulate weight {name!r} shared by stages {stages}",
                                where="emulate", fix="use a model without weights tied across stages")
            self.stage[name] = stages[0]
        num_stages = rule.num_stages
        self.owned = [[n for n in self.names if self.stage[n] == s] for s in range(num_stages)]
        params = dict(model.named_parameters())
        self.live = [[nn.Parameter(params[n].detach().clone()) for n in names] for names in self.owned]
        self.optimizers = [optimizer(live) if live else None for live in self.live]
        self.base_lrs = [[g["lr"] for g in o.param_groups] if o else [] for o in self.optimizers]
        self.versions = [[tuple(p.detach().clone() for p in live)] for live in self.live]
        self.delta = [[torch.zeros_like(p) for p in live] for live in self.live]
        self.grads: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(num_stages)]
        self.starts = [model.get_submodule(name) for name in layout.stage_starts]

    def weights(self, versions: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Parameter name -> tensor, from one weight list per stage."""
        return {n: versions[s][k] for s, names in enumerate(self.owned) for k, n in enumerate(names)}

    def run(self, inputs: tuple, target: torch.Tensor, i: int, loss_fn, weight: float = 1.0) -> float:
        """Forward and backward of microbatch ``i`` (its loss times ``weight``); its gradients go into its update."""
        rule = self.rule
        forward = [self.versions[s][rule.forward_version(s, i)] for s in range(rule.num_stages)]
        if weight != 1.0:
            loss_fn = _weighted(loss_fn, weight)
        if rule.stashes:
            leaves = [[t.detach().requires_grad_() for t in ws] for ws in forward]
            loss = loss_fn(functional_call(self.model, self.weights(leaves), inputs), target)
            (loss / rule.updates_every).backward()
        else:
            loss, leaves = self._pipemare(forward, inputs, target, i, loss_fn)
        update = rule.update_of(i)
        for s, ws in enumerate(leaves):
            total = self.grads[s].setdefault(update, [torch.zeros_like(w) for w in ws])
            for acc, w in zip(total, ws):
                if w.grad is not None:
                    acc.add_(w.grad)
        return float(loss.detach())

    def _pipemare(self, forward, inputs, target, i, loss_fn):
        recorded: list[torch.Tensor] = []
        hooks = [m.register_forward_pre_hook(lambda _m, args: recorded.append(args[0].detach()))
                 for m in self.starts]
        with torch.no_grad():
            loss = loss_fn(functional_call(self.model, self.weights(forward), inputs), target)
        for h in hooks:
            h.remove()
        leaves = []
        for s in range(self.rule.num_stages):
            lag = self.rule.backward_version(s, i) - self.rule.forward_version(s, i)
            current = self.versions[s][self.rule.backward_version(s, i)]
            leaves.append([w.requires_grad_() for w in corrected_weights(current, self.delta[s], lag)])
        slots = iter(recorded)
        hooks = [m.register_forward_pre_hook(lambda _m, args: (_Substitute.apply(args[0], next(slots)),) + args[1:])
                 for m in self.starts]
        try:
            again = loss_fn(functional_call(self.model, self.weights(leaves), inputs), target)
            again.backward()
        finally:
            for h in hooks:
                h.remove()
        return loss, leaves

    def update(self, k: int, lr_factor: float = 1.0) -> None:
        """Apply update ``k`` on every stage: its gradient, PipeMare's lr scale (times ``lr_factor``) and delta."""
        for s, live in enumerate(self.live):
            if not live:
                self.versions[s].append(())
                continue
            for p, g in zip(live, self.grads[s].pop(k)):
                p.grad = g
            opt = self.optimizers[s]
            for group, base in zip(opt.param_groups, self.base_lrs[s]):
                group["lr"] = base * self.rule.lr_scale(s, k) * lr_factor
            old = [p.detach().clone() for p in live]
            opt.step()
            for group, base in zip(opt.param_groups, self.base_lrs[s]):
                group["lr"] = base
            if not self.rule.stashes:
                update_velocity(self.delta[s], old, live, decay=self.rule.correction_decay)
            self.versions[s].append(tuple(p.detach().clone() for p in live))


def _weighted(loss_fn, weight: float):
    return lambda output, target: loss_fn(output, target) * weight


def _update_weights(targets: list[torch.Tensor], *, per_update: int, count_tokens) -> list[float]:
    """Each microbatch's loss weight ``n_j · k / N_update`` (runtime/item_count.py, on global microbatches)."""
    counts = [float(count_tokens(t)) for t in targets]
    weights = []
    for j, n in enumerate(counts):
        group = counts[j - j % per_update: j - j % per_update + per_update]
        weights.append(n * per_update / max(sum(group), 1.0))
    return weights


def _microbatch_rows(tensor: torch.Tensor, *, dp: int, num_microbatches: int) -> list[torch.Tensor]:
    """Global microbatch ``j``: the ``j``-th microbatch of every dp rank's slice, in dp order."""
    slices = tensor.chunk(dp, dim=0)
    return [torch.cat([s.chunk(num_microbatches, dim=0)[j] for s in slices]) for j in range(num_microbatches)]


def emulate(model: nn.Module, *, rule: StalenessRule, layout: StageLayout, batches: Sequence[tuple],
            num_microbatches: int, loss_fn, optimizer: Callable, dp: int = 1,
            count_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
            lr_lambda: Callable[[int], float] | None = None) -> EmulationResult:
    """Train ``model`` (left untouched) on ``batches`` [(inputs tuple, target)] under ``rule``; see the module doc.

    ``count_tokens``: for a ``loss_fn`` that is a token mean, the tokens it counts in a target; each
    microbatch's loss is then weighted by its tokens over its update's, as the runtime does
    (runtime/item_count.py), so an update trains on the token mean of its whole batch.
    ``lr_lambda``: every update of the microbatches of batch ``b`` steps with the groups' learning rates
    times ``lr_lambda(b)``: what a ``LambdaLR`` stepped once per batch sets for that batch."""
    emulator = _Emulator(model, rule=rule, layout=layout, optimizer=optimizer)
    losses, i = [], 0
    for b, (inputs, target) in enumerate(batches):
        columns = [_microbatch_rows(t, dp=dp, num_microbatches=num_microbatches) for t in (*inputs, target)]
        weights = [1.0] * num_microbatches if count_tokens is None else _update_weights(
            columns[-1], per_update=rule.updates_every, count_tokens=count_tokens)
        batch_losses = []
        for parts, weight in zip(zip(*columns), weights):
            batch_losses.append(emulator.run(tuple(parts[:-1]), parts[-1], i, loss_fn, weight))
            if rule.closes_update(i):
                emulator.update(rule.update_of(i), 1.0 if lr_lambda is None else lr_lambda(b))
            i += 1
        losses.append(float(torch.tensor(batch_losses, device="cpu").mean()))
    final = {n: p.detach() for names, live in zip(emulator.owned, emulator.live) for n, p in zip(names, live)}
    state = {}
    for name, value in model.state_dict().items():
        state[name] = value
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = next(n for n, q in model.named_parameters() if q is p)
        state[name] = final[owner].clone()
    return EmulationResult(losses, state)
