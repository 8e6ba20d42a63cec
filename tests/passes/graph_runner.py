"""Helpers for the pass tests: cached plans of the tiny models, and a one-process runner of rank graphs.

:func:`planned` caches ``autopar.plan`` results (planning costs about a second), so tests must
only read what it returns. :func:`run_forward` runs every stage of one dp replica in this
process: the tensor-parallel ranks of a stage run in lockstep, node by node, with ``TpReduce``
summing its input over the ranks, ``TpGather`` concatenating every rank's shard, and ``TpCopy``, ``TpGradSum`` and ``TpGroupGradSum`` passing their
input through (their forward semantics); a ``recv_<edge>`` node takes the value the matching ``send_<edge>`` produced.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

import autopar
from autopar.models import build_model, lm_loss
from autopar.ops.collectives import TpCopy, TpGather, TpReduce
from autopar.ops.p2p import RecvActivation, SendActivation
from autopar.ops.tp_ops import TpGradSum, TpGroupGradSum
from autopar.passes.frontend.capture import capture

__all__ = ["BATCH", "SEQ", "example_batch", "tiny_model", "captured", "planned", "run_forward", "call_nodes"]

BATCH, SEQ = 4, 16


def example_batch(vocab_size: int, *, batch: int = BATCH, seq: int = SEQ, seed: int = 0):
    """(inputs, targets) token batches, the same for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (batch, seq), generator=g),
            torch.randint(0, vocab_size, (batch, seq), generator=g))


def tiny_model(name: str, overrides: tuple = ()):
    """A preset built under seed 0 with ``overrides`` ((key, value) pairs); cached, do not mutate."""
    return _tiny_model(name, tuple(overrides))


@functools.lru_cache(maxsize=None)
def _tiny_model(name, overrides):
    torch.manual_seed(0)
    return build_model(name, **dict(overrides))


def captured(name: str, mode: str = "export", *, with_loss: bool = True, batch: int = 2):
    """(model, example args, CapturedGraph) of preset ``name``; cached, do not change the graph."""
    return _captured(name, mode, with_loss, batch)


@functools.lru_cache(maxsize=None)
def _captured(name, mode, with_loss, batch):
    model = tiny_model(name)
    x, y = example_batch(model.cfg.vocab_size, batch=batch)
    if with_loss:
        return model, (x, y), capture(model, (x,), loss_fn=lm_loss, example_target=y, mode=mode)
    return model, (x,), capture(model, (x,), mode=mode)


def planned(name: str, *, dp: int = 1, pp: int = 1, tp: int = 1, overrides: tuple = (),
            batch: int = BATCH, options: tuple = ()):
    """(model, inputs, targets, PlanResult) for a training plan of preset ``name``; cached.

    Tensor parallelism is Megatron's blocks only (``vocab_parallel=False``) unless ``options`` say.
    """
    return _planned(name, dp, pp, tp, tuple(overrides), batch, tuple(options))


@functools.lru_cache(maxsize=None)
def _planned(name, dp, pp, tp, overrides, batch, options):
    model = tiny_model(name, overrides)
    x, y = example_batch(model.cfg.vocab_size, batch=batch)
    chosen = {"vocab_parallel": False, **dict(options)}
    result = autopar.plan(model, {"dp": dp, "pp": pp, "tp": tp}, example_inputs=(x,), loss_fn=lm_loss,
                          example_target=y, **chosen)
    return model, x, y, result


def call_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]


def _lockstep(gms: list[fx.GraphModule], args: list[list[torch.Tensor]], sent: dict) -> list:
    """Run the tp ranks' graphs of one stage node by node; returns each rank's output."""
    interps = [fx.Interpreter(gm) for gm in gms]
    for interp, a in zip(interps, args):
        interp.env = {}
        interp.args_iter = iter(a)
    columns = [list(gm.graph.nodes) for gm in gms]
    assert all([n.name for n in c] == [n.name for n in columns[0]] for c in columns)
    outputs = [None] * len(gms)
    for row in zip(*columns):
        first = row[0]
        module = gms[0].get_submodule(first.target) if first.op == "call_module" else None
        if isinstance(module, TpReduce):
            total = sum(i.env[n.args[0]] for i, n in zip(interps, row))
            for i, n in zip(interps, row):
                i.env[n] = total.clone()
        elif isinstance(module, TpGather):  # a gathered column's output: every rank's shard, concatenated
            total = torch.cat([i.env[n.args[0]] for i, n in zip(interps, row)], dim=module.dim)
            for i, n in zip(interps, row):
                i.env[n] = total.clone()
        elif isinstance(module, (TpCopy, TpGradSum, TpGroupGradSum)):  # identity forward
            for i, n in zip(interps, row):
                i.env[n] = i.env[n.args[0]]
        elif isinstance(module, RecvActivation):
            for t, (i, n) in enumerate(zip(interps, row)):
                i.env[n] = sent[(module.edge, t)]
        elif isinstance(module, SendActivation):
            for t, (i, n) in enumerate(zip(interps, row)):
                sent[(module.edge, t)] = i.env[n] = i.env[n.args[0]]
        else:
            for t, (i, n) in enumerate(zip(interps, row)):
                value = i.run_node(n)
                if n.op == "output":
                    outputs[t] = value
                else:
                    i.env[n] = value
    return outputs


@torch.no_grad()
def run_forward(result, inputs: dict[str, torch.Tensor]) -> list:
    """Every stage of dp replica 0 run in order; the last stage's output on each tp rank."""
    shape = result.plan.mesh
    num_stages = len(result.lowered[0].stages)
    sent: dict = {}
    outputs = None
    for stage in range(num_stages):
        stage_graphs = [result.lowered[t].stages[stage] for t in range(shape.tp)]
        args = [[inputs[name] for name in s.input_names] for s in stage_graphs]
        outputs = _lockstep([s.gm for s in stage_graphs], args, sent)
    return outputs


def reference_loss(model, x, y) -> torch.Tensor:
    with torch.no_grad():
        return lm_loss(model(x), y)
