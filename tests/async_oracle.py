"""An oracle of the asynchronous schedules that shares no code with autopar: a plain loop in one process,
on the unsplit model, keeping every weight version of every stage by hand.

It imports nothing from autopar. The rules are written here from the papers, in their own words:

- PipeDream (Narayanan et al. 2019): an update after every microbatch. Stage ``s`` of ``p`` runs
  ``p - 1 - s`` forwards ahead of its backwards, so the forward of microbatch ``i`` reads the weights after
  ``i - (p - 1 - s)`` updates (none before the first); its backward reads the same (weight stashing).
- PipeDream-2BW (Narayanan et al. 2021): one update per batch of ``m`` microbatches with the batch's mean
  gradient, applied one batch late: every stage reads, for batch ``t``, the weights after ``t - 1`` updates
  (``W(t+1) = W(t) - lr * grad f(W(t-1))``).
- PipeMare (Yang et al. 2021): an update after every microbatch, no stashing. The forward reads PipeDream's
  version; the backward reads the newest, after ``i`` updates, corrected back toward the forward's by the
  lag times ``delta``, the stage's running average of its update steps (``delta <- decay * delta +
  (1 - decay) * (w_after - w_before)``); the learning rate of stage ``s`` at update ``k`` is scaled by
  ``max(1, p - 1 - s) ** -(1 - min(k / K, 1))`` (``K``: the warm-up updates, 0 for none). The backward
  evaluates each stage at the input its forward saw (the recorded stage inputs replace the recomputed ones).

Microbatches run one after another, each through the whole model with each stage's weights at the version
named above; an update is applied as soon as its last microbatch is done. ``max_grad_norm``: each update's
gradient, every stage's together (each parameter once), is clipped by torch's ``clip_grad_norm_`` before it
is applied. ``lr_lambda``: a scheduler stepped once per batch; every update of batch ``b`` (the batch its
microbatches belong to) steps with the learning rate times ``lr_lambda(b)``. The stage of a parameter is found by running the model once: a parameter belongs to the number of
``stage_starts`` modules that ran before (or as) its own module.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

__all__ = ["Oracle", "OracleResult", "run_oracle", "versions_read"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Oracle:
    """What the oracle is told: the rule by name and its numbers, and where the model is cut."""

    kind: str  # "pipedream", "2bw" or "pipemare"
    num_stages: int
    num_microbatches: int  # per batch (2BW's update size)
    stage_starts: tuple[str, ...]  # module paths where stages 1, 2, ... begin
    lr_warmup_updates: int = 0  # PipeMare's K
    correction_decay: float = 0.5  # PipeMare's decay
    max_grad_norm: float | None = None
    batches_late: int = 1  # 2BW's delay in batches (0: every batch reads the newest weights, no staleness)
    lr_lambda: Callable[[int], float] | None = None  # a scheduler per batch: every update of batch b scales lr by it


@dataclasses.dataclass
class OracleResult:
    losses: list[float]  # each batch's mean microbatch loss
    state: dict[str, torch.Tensor]  # the weights after the last update (every name, tied ones included)


def versions_read(o: Oracle, stage: int, i: int) -> tuple[int, int]:
    """(updates the forward of microbatch ``i`` on ``stage`` reads, updates its backward reads)."""
    ahead = o.num_stages - 1 - stage
    if o.kind == "2bw":
        batch_version = max(0, i // o.num_microbatches - o.batches_late)
        return batch_version, batch_version
    forward = max(0, i - ahead)
    return (forward, i) if o.kind == "pipemare" else (forward, forward)


def _per_update(o: Oracle) -> int:
    return o.num_microbatches if o.kind == "2bw" else 1


class _Recorded(torch.autograd.Function):
    """Forward: the stage input the forward pass saw. Backward: the gradient goes on to the stage before."""

    @staticmethod
    def forward(ctx, x, recorded):
        return recorded.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _param_stages(model: nn.Module, starts: Sequence[str], inputs: tuple) -> dict[str, int]:
    """{parameter name: stage}, from the order in which the model's modules first run."""
    first: dict[str, int] = {}

    def seen(name):
        def hook(_module, _args):
            first.setdefault(name, len(first))
        return hook

    hooks = [m.register_forward_pre_hook(seen(name)) for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    begins = [first[s] for s in starts]
    return {name: sum(first[name.rpartition(".")[0]] >= b for b in begins)
            for name, _ in model.named_parameters(remove_duplicate=False)}


class _Loop:
    """Every stage's weight versions, optimizer, PipeMare delta and pending gradients."""

    def __init__(self, model: nn.Module, o: Oracle, optimizer: Callable, example: tuple):
        self.model, self.o = model, o
        every = _param_stages(model, o.stage_starts, example)
        stage_of = {}
        for name, p in model.named_parameters():
            stages = {every[alias] for alias, q in model.named_parameters(remove_duplicate=False) if q is p}
            if len(stages) > 1 and o.kind != "2bw":
                raise ValueError(f"{o.kind} keeps one clock per stage: {name} is used on stages {sorted(stages)}")
            stage_of[name] = min(stages)  # 2BW: every stage reads the same version, the copies' gradients summed
        self.names = [[n for n in stage_of if stage_of[n] == s] for s in range(o.num_stages)]
        params = dict(model.named_parameters())
        self.live = [[nn.Parameter(params[n].detach().clone()) for n in names] for names in self.names]
        self.opts = [optimizer(live) if live else None for live in self.live]
        self.base_lr = [[g["lr"] for g in opt.param_groups] if opt else [] for opt in self.opts]
        self.versions = [[[p.detach().clone() for p in live]] for live in self.live]  # versions[s][k]
        self.delta = [[torch.zeros_like(p) for p in live] for live in self.live]
        self.pending: dict[int, list[list[torch.Tensor]]] = {}
        self.starts = [model.get_submodule(s) for s in o.stage_starts]

    def _call(self, weights: list[list[torch.Tensor]], inputs: tuple):
        named = {n: w for names, ws in zip(self.names, weights) for n, w in zip(names, ws)}
        return functional_call(self.model, named, inputs)

    def microbatch(self, i: int, inputs: tuple, target, loss_fn, weight: float) -> float:
        """Forward and backward of microbatch ``i``; its gradient goes to its update. Returns its loss."""
        o = self.o
        reads = [versions_read(o, s, i) for s in range(o.num_stages)]
        forward = [self.versions[s][f] for s, (f, _) in enumerate(reads)]
        if o.kind != "pipemare":
            leaves = [[w.detach().clone().requires_grad_() for w in ws] for ws in forward]
            loss = loss_fn(self._call(leaves, inputs), target) * weight
            grads = torch.autograd.grad(loss / _per_update(o), [w for ws in leaves for w in ws], allow_unused=True)
        else:
            seen: list[torch.Tensor] = []
            hooks = [m.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach())) for m in self.starts]
            with torch.no_grad():
                loss = loss_fn(self._call(forward, inputs), target) * weight
            for h in hooks:
                h.remove()
            leaves = []
            for s, (f, b) in enumerate(reads):  # the newest weights, corrected by the lag
                leaves.append([(w - (b - f) * d).detach().requires_grad_()
                               for w, d in zip(self.versions[s][b], self.delta[s])])
            slots = iter(seen)
            hooks = [m.register_forward_pre_hook(lambda _m, a: (_Recorded.apply(a[0], next(slots)),) + a[1:])
                     for m in self.starts]
            try:
                again = loss_fn(self._call(leaves, inputs), target) * weight
                grads = torch.autograd.grad(again, [w for ws in leaves for w in ws], allow_unused=True)
            finally:
                for h in hooks:
                    h.remove()
        k = i // _per_update(o)
        flat = iter(grads)
        per_stage = [[next(flat) for _ in ws] for ws in leaves]
        total = self.pending.setdefault(k, [[torch.zeros_like(w) for w in ws] for ws in leaves])
        for acc_s, g_s in zip(total, per_stage):
            for acc, g in zip(acc_s, g_s):
                if g is not None:
                    acc.add_(g)
        return float(loss.detach())

    def update(self, k: int) -> None:
        """Apply update ``k`` on every stage: clipped over every stage together, then each stage's own step."""
        o, grads = self.o, self.pending.pop(k)
        for live, gs in zip(self.live, grads):
            for p, g in zip(live, gs):
                p.grad = g.clone()
        if o.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for live in self.live for p in live], o.max_grad_norm)
        for s, (live, opt) in enumerate(zip(self.live, self.opts)):
            if opt is None:
                self.versions[s].append([])
                continue
            scale = 1.0 if o.lr_lambda is None else o.lr_lambda(k * _per_update(o) // o.num_microbatches)
            if o.kind == "pipemare" and o.lr_warmup_updates:
                scale *= float(max(1, o.num_stages - 1 - s)) ** -(1.0 - min(k / o.lr_warmup_updates, 1.0))
            for group, lr in zip(opt.param_groups, self.base_lr[s]):
                group["lr"] = lr * scale
            before = [p.detach().clone() for p in live]
            opt.step()
            for group, lr in zip(opt.param_groups, self.base_lr[s]):
                group["lr"] = lr
            if o.kind == "pipemare":
                self.delta[s] = [o.correction_decay * d + (1 - o.correction_decay) * (p.detach() - b)
                                 for d, p, b in zip(self.delta[s], live, before)]
            self.versions[s].append([p.detach().clone() for p in live])


def _rows(tensor: torch.Tensor, *, dp: int, m: int) -> list[torch.Tensor]:
    """Global microbatch ``j``: the ``j``-th microbatch of each dp rank's slice of the batch, in dp order."""
    slices = tensor.chunk(dp, dim=0)
    return [torch.cat([s.chunk(m, dim=0)[j] for s in slices]) for j in range(m)]


def run_oracle(model: nn.Module, o: Oracle, *, batches: Sequence[tuple], loss_fn, optimizer: Callable, dp: int = 1,
               count_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None) -> OracleResult:
    """Train ``model`` (left untouched) on ``batches`` [(inputs tuple, target)] as the module doc says.

    ``count_tokens``: for a token-mean ``loss_fn``, the tokens it counts in a target; each microbatch's loss
    is then weighted by its tokens times the update's microbatches over the update's tokens, so each update
    trains on the token mean of all its microbatches."""
    m, every = o.num_microbatches, _per_update(o)
    loop = _Loop(model, o, optimizer, example=tuple(_rows(t, dp=dp, m=m)[0] for t in batches[0][0]))
    losses, i = [], 0
    for inputs, target in batches:
        columns = [_rows(t, dp=dp, m=m) for t in (*inputs, target)]
        weights = [1.0] * m
        if count_tokens is not None:
            counts = [float(count_tokens(t)) for t in columns[-1]]
            weights = [n * every / max(sum(counts[j - j % every: j - j % every + every]), 1.0)
                       for j, n in enumerate(counts)]
        batch = []
        for parts, weight in zip(zip(*columns), weights):
            batch.append(loop.microbatch(i, tuple(parts[:-1]), parts[-1], loss_fn, weight))
            if (i + 1) % every == 0:
                loop.update(i // every)
            i += 1
        losses.append(sum(batch) / len(batch))
    final = {n: p.detach() for names, live in zip(loop.names, loop.live) for n, p in zip(names, live)}
    state = dict(model.state_dict())
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = next(n for n, q in model.named_parameters() if q is p)
        state[name] = final[owner].clone()
    return OracleResult(losses, state)
