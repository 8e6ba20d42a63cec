"""The schedule executor: runs one rank's actions on its stage graphs.

F runs a stage graph on a microbatch (recv/send nodes inside it do the p2p); B runs autograd
backward from the stage's outputs: the last stage's loss (scaled by 1/num_microbatches), or the
send tokens of an inner stage, whose backward receives the gradient from the next stage.
When the schedule splits backward (zero bubble), B computes activation gradients only and W the
weight gradients, from what :func:`autopar.passes.pipeline.weight_grad_split.expose_weight_uses` exposed.
A stage that sends no gradient upstream (the first stage: its inputs are tokens) gains nothing
from the split: nobody waits for its B. There B only keeps the microbatch's outputs and W runs
the whole backward in one autograd call, as torch.distributed.pipelining does for stage 0, which
saves the split's second walk of the graph and its per-use bookkeeping; since the work moves
later, never earlier, no send of this rank is delayed by it.
In a schedule whose data says a B followed at once by its own W is a full backward
(``Schedule.full_backward``: DualPipe and DualPipeV write theirs so), the B runs both in one
autograd call, the activation gradients for the upstream stage and the weight gradients at the
uses, and the W records nothing left to do, as torch's ScheduleDualPipeV runs a full backward.
That saves the split's second walk of the graph (DualPipeV's CPU per step was 3-5% over torch's);
the weight gradients are added to ``.grad`` by the same use-ordered accumulation as a W's. In a
zero-bubble schedule the same adjacency is left split: there the B's gradient must leave before the
W's work (fusing ZB-V's measured 6.9% bubble to 11.8%).
Receives are posted one action ahead: while an action computes, the activations its successor
reads (a forward's recv nodes) and the gradients it waits for (a backward's, as its forward's
sends noted them) are already on their way, so a transfer's latency hides under compute.
Only validated schedules run (the caller validates).
Each action is an entry of the rank's flight record (ops/flight_record.py) when the channel
carries one, open while it runs, and its event notes the seconds it spent blocked in collectives.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from autopar.errors import ScheduleError
from autopar.ir.captured_graph import LOSS_WEIGHT
from autopar.ir.dynamic_shapes import batch_sizes
from autopar.ir.stage_graph import StageGraph
from autopar.ops.flight_record import ACTION
from autopar.ops.p2p import P2PChannel, forward_receives
from autopar.runtime.execution.item_count import weighted_loss
from autopar.runtime.schedules.action import Action, ActionKind

__all__ = ["run_actions", "ActionEvent"]

log = logging.getLogger(__name__)


class ActionEvent(tuple):
    """(action string, start, end) in seconds since the step began.

    ``wait_s``: the part of it spent blocked on a peer's transfer; ``comm_s``: the part blocked in
    collectives (a tensor-parallel all-reduce; known with a flight record); ``origin``: the step's start
    (``time.perf_counter()``), which lines up the events of ranks on one host (runtime/execution/trace.py).
    """

    wait_s = 0.0
    comm_s = 0.0
    origin = 0.0

    @classmethod
    def timed(cls, action: str, t0: float, t1: float, *, origin: float, wait_s: float,
              comm_s: float = 0.0) -> ActionEvent:
        event = cls((action, t0 - origin, t1 - origin))
        event.wait_s, event.comm_s, event.origin = wait_s, comm_s, origin
        return event


def _forward(stage: StageGraph, batch: dict, channel: P2PChannel, microbatch: int):
    channel.microbatch = microbatch
    channel.sizes = batch_sizes(stage.dynamic, batch) if stage.dynamic else {}
    return weigh_loss(stage, stage.gm(*[batch[name] for name in stage.input_names]), batch)


def weigh_loss(stage: StageGraph, out, batch: dict):
    """The last stage's output with its loss weighted by the microbatch's tokens where the batch carries
    a weight (a token-mean ``loss_fn``: passes/frontend/mean_loss.py, runtime/execution/item_count.py); else ``out``."""
    if not (stage.is_last and LOSS_WEIGHT in batch):
        return out
    if isinstance(out, (tuple, list)):
        return type(out)((weighted_loss(out[0], batch[LOSS_WEIGHT]), *out[1:]))
    return weighted_loss(out, batch[LOSS_WEIGHT])


def _roots(stage: StageGraph, primary, num_microbatches: int):
    """What backward starts from: the scaled loss, or the send tokens that carry a gradient."""
    if stage.is_last:
        loss = primary[0] if isinstance(primary, (tuple, list)) else primary
        return [loss / num_microbatches], [None]
    tokens = [t for t in primary if isinstance(t, torch.Tensor) and t.requires_grad]
    return tokens, [torch.ones_like(t) for t in tokens]


def _backward(stage: StageGraph, out, num_microbatches: int) -> None:
    roots, grads = _roots(stage, out, num_microbatches)
    if roots:
        torch.autograd.backward(roots, [g for g in grads] if grads[0] is not None else None)


def _backward_input(stage: StageGraph, out, num_microbatches: int, channel: P2PChannel, microbatch: int):
    """Split backward, B: activation gradients only; returns what W needs."""
    layout = stage.weight_uses
    n_primary, n_recv, k = layout.num_primary, layout.num_received, len(layout.params)
    received = list(out[n_primary:n_primary + n_recv])
    uses = list(out[n_primary + n_recv:n_primary + n_recv + k])
    aliases = list(out[n_primary + n_recv + k:])
    roots, grads = _roots(stage, out[:n_primary], num_microbatches)
    wanted = received + uses
    found = torch.autograd.grad(roots, wanted, grads if grads and grads[0] is not None else None,
                                retain_graph=True, allow_unused=True) if roots and wanted else [None] * len(wanted)
    _send_input_gradients(stage, received, found[:n_recv], channel, microbatch)
    return uses, aliases, list(found[n_recv:])


def _send_input_gradients(stage: StageGraph, received: list, grads, channel: P2PChannel, microbatch: int) -> None:
    """Send each received activation's gradient back to the stage it came from (zeros where none)."""
    edges = [e for e in stage.recvs if e.requires_grad]
    for edge, value, grad in zip(edges, received, grads):
        channel.send(grad if grad is not None else torch.zeros_like(value), stage=edge.src, edge=edge.index,
                     microbatch=microbatch, is_grad=True)


def _backward_fused(stage: StageGraph, out, num_microbatches: int, channel: P2PChannel, microbatch: int) -> None:
    """B and its W at once: one ``autograd.grad`` for the received activations' and the weights' gradients."""
    layout = stage.weight_uses
    n_primary, n_recv, k = layout.num_primary, layout.num_received, len(layout.params)
    received = list(out[n_primary:n_primary + n_recv])
    aliases = list(out[n_primary + n_recv + k:])
    roots, grads = _roots(stage, out[:n_primary], num_microbatches)
    wanted = received + aliases
    found = torch.autograd.grad(roots, wanted, grads if grads and grads[0] is not None else None,
                                allow_unused=True) if roots and wanted else [None] * len(wanted)
    _send_input_gradients(stage, received, found[:n_recv], channel, microbatch)
    pending: dict[str, list] = {}
    for i, dw in enumerate(found[n_recv:]):
        if dw is not None:
            pending.setdefault(layout.params[i], []).append((i, dw))
    for target, contributions in pending.items():
        _accumulate(stage.gm.get_parameter(target), contributions)


def _weight_of(following: Action, backward: Action) -> bool:
    """Whether ``following`` is the W of ``backward``'s stage and microbatch."""
    return (following.kind is ActionKind.W and following.stage == backward.stage
            and following.microbatch == backward.microbatch)


def _whole_at_w(stage: StageGraph) -> bool:
    """Split backward where no gradient leaves the stage: W runs the whole backward (module doc)."""
    return stage.weight_uses.num_received == 0


def _backward_weight(stage: StageGraph, saved) -> None:
    """Split backward, W: the weight gradients of every use, from the gradients B kept at the uses.

    One ``autograd.grad`` per group of uses (``WeightUses.groups``: none of a group feeds another,
    so each alias gets its own use's gradient only, as with one call per use). A parameter's
    contributions are added to ``.grad`` in use order once all are in, so the sums are the same
    as one call per use would make.
    """
    uses, aliases, grads = saved
    layout = stage.weight_uses
    left = Counter(layout.params[i] for i, grad in enumerate(grads) if grad is not None)
    pending: dict[str, list] = {}
    for group in layout.groups:
        live = [i for i in group if grads[i] is not None]
        if not live:
            continue
        heads: dict[int, int] = {}  # a use read by several aliases (weight and bias) is one output
        for i in live:
            heads.setdefault(id(uses[i]), i)
        found = torch.autograd.grad([uses[i] for i in heads.values()], [aliases[i] for i in live],
                                    [grads[i] for i in heads.values()], retain_graph=True)
        for i, dw in zip(live, found):
            target = layout.params[i]
            pending.setdefault(target, []).append((i, dw))
            left[target] -= 1
            if left[target] == 0:
                _accumulate(stage.gm.get_parameter(target), pending.pop(target))


def _accumulate(param: torch.nn.Parameter, contributions: list[tuple[int, torch.Tensor]]) -> None:
    """Add ``contributions`` to ``param.grad`` in use order.

    The first gradient is taken as it is when it has the parameter's layout (it may be shared,
    e.g. one tensor for two aliases); one in another layout (a linear's weight gradient arrives
    transposed) is copied into the parameter's, as autograd's own accumulation does, so the
    optimizer and the gradient collectives read it contiguously. The first sum makes a tensor only
    this parameter holds, and later ones add into it in place (the same values as a new sum,
    without allocating a gradient-sized tensor per microbatch).
    """
    for _, dw in sorted(contributions, key=lambda c: c[0]):
        grad = param.grad
        if grad is None and dw.stride() == param.stride():
            param.grad = dw
        elif grad is None:
            total = torch.empty_like(param, memory_format=torch.preserve_format).copy_(dw)
            total._autopar_owned_sum = True
            param.grad = total
        elif getattr(grad, "_autopar_owned_sum", False):
            grad.add_(dw)
        else:
            total = grad + dw
            total._autopar_owned_sum = True
            param.grad = total


class _Receives(dict):
    """The recv nodes of each stage graph, found once per graph."""

    def __missing__(self, gm):
        self[gm] = forward_receives(gm)
        return self[gm]


def run_actions(actions: tuple[Action, ...], *, stages: dict[int, StageGraph] | list, microbatches: list[dict],
                channel: P2PChannel, train: bool, events: list | None = None,
                full_backward: bool = False) -> dict[int, object]:
    """Run ``actions`` in order; returns the last stage's output per microbatch (if this rank has it).

    ``stages``: this rank's stage graphs, or a list of them per microbatch (a microbatch of another
    shape runs graphs of its own: runtime/execution/shape_cache.py). ``full_backward``: the schedule's
    ``Schedule.full_backward`` (a B followed by its W runs as one).
    """
    per_microbatch = stages if isinstance(stages, list) else [stages] * len(microbatches)
    held: dict[tuple[int, int], object] = {}
    saved: dict[tuple[int, int], object] = {}
    fused: set[tuple[int, int]] = set()  # (stage, microbatch) whose W its B already ran
    results: dict[int, object] = {}
    receives = _Receives()
    flight = channel.flight
    start = time.perf_counter()
    for index, action in enumerate(actions):
        if index + 1 < len(actions):  # the next action's transfers land while this one computes
            _post_receives(actions[index + 1], receives=receives, channel=channel, train=train,
                           stages=per_microbatch, microbatches=microbatches)
        channel.action = name = str(action)
        if flight is not None:
            entry = flight.begin(ACTION, name, stage=action.stage, microbatch=action.microbatch)
            comm = flight.comm_wait_s
        t0, waited = time.perf_counter(), channel.wait_s
        stage = per_microbatch[action.microbatch][action.stage]
        if action.kind is ActionKind.F:
            out = _forward(stage, microbatches[action.microbatch], channel, action.microbatch)
            if train:
                held[(action.stage, action.microbatch)] = out
            if stage.is_last:
                results[action.microbatch] = _detach(out)
        elif action.kind is ActionKind.B and train:
            out = held.pop((action.stage, action.microbatch))
            if stage.weight_uses is None:
                _backward(stage, out, len(microbatches))
            elif _whole_at_w(stage):
                saved[(action.stage, action.microbatch)] = out[:stage.weight_uses.num_primary]
            elif full_backward and index + 1 < len(actions) and _weight_of(actions[index + 1], action):
                _backward_fused(stage, out, len(microbatches), channel, action.microbatch)
                fused.add((action.stage, action.microbatch))
            else:
                saved[(action.stage, action.microbatch)] = _backward_input(
                    stage, out, len(microbatches), channel, action.microbatch)
        elif action.kind is ActionKind.W and train:
            if stage.weight_uses is None:
                raise ScheduleError(f"action {action} computes weight gradients, but stage {action.stage} "
                                    f"was not prepared for split backward", where=f"stage {action.stage}",
                                    fix="compile with the schedule that contains W actions")
            if (action.stage, action.microbatch) in fused:
                fused.discard((action.stage, action.microbatch))  # its B did it (_backward_fused)
            elif _whole_at_w(stage):
                _backward(stage, saved.pop((action.stage, action.microbatch)), len(microbatches))
            else:
                _backward_weight(stage, saved.pop((action.stage, action.microbatch)))
        if flight is not None:
            flight.end(entry)
        if events is not None:
            events.append(ActionEvent.timed(name, t0, time.perf_counter(), origin=start, wait_s=channel.wait_s - waited,
                                            comm_s=flight.comm_wait_s - comm if flight is not None else 0.0))
    channel.flush()
    return results


def _post_receives(action: Action, *, receives: _Receives, channel: P2PChannel, train: bool, stages: list,
                   microbatches: list[dict]) -> None:
    if action.kind is ActionKind.F:
        stage = stages[action.microbatch][action.stage]
        sizes = batch_sizes(stage.dynamic, microbatches[action.microbatch]) if stage.dynamic else None
        channel.post_forward(receives[stage.gm], microbatch=action.microbatch, sizes=sizes)
    elif action.kind is ActionKind.B and train:
        channel.post_backward(stage=action.stage, microbatch=action.microbatch)


def _detach(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    return out
