"""The schedule executor: runs one rank's actions on its stage graphs.

F runs a stage graph on a microbatch (recv/send nodes inside it do the p2p); B runs autograd
backward from the stage's outputs: the last stage's loss (scaled by 1/num_microbatches), or the
send tokens of an inner stage, whose backward receives the gradient from the next stage.
Only validated schedules run (the caller validates); W actions need split backward support.
"""
from __future__ import annotations

import logging
import time

import torch

from autopar.errors import ScheduleError
from autopar.passes.pipeline_split import StageGraph
from autopar.runtime.p2p import P2PChannel
from autopar.runtime.schedules.action import Action, ActionKind

__all__ = ["run_actions", "ActionEvent"]

log = logging.getLogger(__name__)


class ActionEvent(tuple):
    """(action string, start, end) in seconds since the step began."""


def _forward(stage: StageGraph, batch: dict, channel: P2PChannel, microbatch: int):
    channel.microbatch = microbatch
    return stage.gm(*[batch[name] for name in stage.input_names])


def _backward(stage: StageGraph, out, num_microbatches: int) -> None:
    if stage.is_last:
        loss = out[0] if isinstance(out, (tuple, list)) else out
        (loss / num_microbatches).backward()
        return
    tokens = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
    if tokens:
        torch.autograd.backward(tokens, [torch.ones_like(t) for t in tokens])


def run_actions(actions: tuple[Action, ...], *, stages: dict[int, StageGraph], microbatches: list[dict],
                channel: P2PChannel, train: bool, events: list | None = None) -> dict[int, object]:
    """Run ``actions`` in order; returns the last stage's output per microbatch (if this rank has it)."""
    held: dict[tuple[int, int], object] = {}
    results: dict[int, object] = {}
    start = time.perf_counter()
    for action in actions:
        channel.action = str(action)
        t0 = time.perf_counter()
        stage = stages[action.stage]
        if action.kind is ActionKind.F:
            out = _forward(stage, microbatches[action.microbatch], channel, action.microbatch)
            if train:
                held[(action.stage, action.microbatch)] = out
            if stage.is_last:
                results[action.microbatch] = _detach(out)
        elif action.kind is ActionKind.B and train:
            _backward(stage, held.pop((action.stage, action.microbatch)), len(microbatches))
        elif action.kind is ActionKind.W:
            raise ScheduleError(f"action {action} is a separate weight-gradient step",
                                where=f"stage {action.stage}",
                                fix="choose a schedule without split backward (gpipe, 1f1b, interleaved_1f1b)")
        if events is not None:
            events.append(ActionEvent((str(action), t0 - start, time.perf_counter() - start)))
    channel.flush()
    return results


def _detach(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    return out
