"""One tensor-parallel group's forward AND backward in one process: every tp rank's stage graphs, run in
lockstep, their collectives emulated here from their published definitions (Megatron's f and g), not by
the runtime's own code.

Each rank's graph runs node by node on its own values (``fx.Interpreter.run_node``); at a collective
node every rank's input is at hand, and the output of rank ``r`` is built so that autograd gives rank
``r`` exactly the gradient its distributed backward would. The device: ``x_q.detach()`` is rank ``q``'s
value without a path back to it, so a rank's output only sends gradient where the collective's
backward does:

=========================== ============================== ==========================================
collective                  forward on rank r              backward (what rank r's input receives)
=========================== ============================== ==========================================
TpCopy, TpGradSum (f)       x_r                            sum over ranks of their output gradients
TpReduce (g)                sum_q x_q                      rank r's output gradient
TpPartialSum(scale)         scale * sum_q x_q              scale * rank r's output gradient
TpGather(dim)               cat_q x_q on dim               rank r's slice of its output gradient
TpScatter(dim)              rank r's slice of x_r on dim   every rank's output gradient, concatenated
TpGroupGradSum(blocks)      x_r                            per block, summed over ranks holding its piece
VocabParallelCrossEntropy   torch's cross_entropy of the   rank r's vocabulary slice of torch's
                            shards laid out by vocab_start gradient of it
=========================== ============================== ==========================================

Every rank's loss is backpropagated with gradient 1, as each distributed rank does with its own.
:func:`run_train` returns each rank's loss and the gradient of each of its parameters.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from autopar.ops.collectives import GraphCollective, TpCopy, TpGather, TpReduce, TpScatter
from autopar.ops.p2p import RecvActivation, SendActivation
from autopar.ops.tp_ops import TpGradSum, TpGroupGradSum, VocabParallelCrossEntropy
from autopar.ops.tp_reduce_ops import TpPartialSum

__all__ = ["run_train", "shard_of"]


def _own(xs: list, r: int) -> list:
    """Every rank's value, only rank ``r``'s own with a path back for autograd."""
    return [x if q == r else x.detach() for q, x in enumerate(xs)]


def _through(x: torch.Tensor) -> torch.Tensor:
    """Zero in value, identity for the gradient: another rank's tensor seen from this one."""
    return x - x.detach()


def _copy(xs: list) -> list:
    return [xs[r] + sum(_through(x) for q, x in enumerate(xs) if q != r) for r in range(len(xs))]


def _group_copy(xs: list, module: TpGroupGradSum) -> list:
    """Per block of ``module.blocks`` (local size, parts): gradients summed over the ranks of its piece."""
    size, out = len(xs), []
    for r in range(size):
        total, offset = xs[r], 0
        for local, parts in module.blocks:
            if parts:
                mask = torch.zeros_like(xs[r])
                mask.narrow(module.dim, offset, local).fill_(1)
                peers = [q for q in range(size) if q != r and q * parts // size == r * parts // size]
                total = total + sum(mask * _through(xs[q]) for q in peers)
            offset += local
        out.append(total)
    return out


def _scatter(xs: list, dim: int) -> list:
    size = len(xs)
    return [xs[r].chunk(size, dim)[r] + sum(_through(xs[q].chunk(size, dim)[r]) for q in range(size) if q != r)
            for r in range(size)]


def _vocab_ce(rows: list, modules: list) -> list:
    """Torch's cross-entropy of the whole logits, laid out by each rank's ``vocab_start``."""
    order = sorted(range(len(rows)), key=lambda r: modules[r].vocab_start)
    edge = 0
    for r in order:  # the shards tile the vocabulary, each where its rank says it starts
        logits = rows[r][0]
        assert (modules[r].vocab_start, modules[r].vocab_end) == (edge, edge + logits.shape[-1])
        edge += logits.shape[-1]
    out = []
    for r, (_, target) in enumerate(rows):
        mine = _own([row[0] for row in rows], r)
        logits = torch.cat([mine[q] for q in order], dim=-1)
        m = modules[r]
        out.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                   ignore_index=m.ignore_index, reduction=m.reduction).to(logits.dtype))
    return out


def _collective(module, values: list) -> list:
    """Every rank's output of ``module`` from every rank's input values (``values[r]``: rank r's args)."""
    xs = [v[0] for v in values]
    if isinstance(module, (TpCopy, TpGradSum)):
        return _copy(xs)
    if isinstance(module, TpPartialSum):
        return [module.scale * sum(_own(xs, r)) for r in range(len(xs))]
    if isinstance(module, TpReduce):
        return [sum(_own(xs, r)) for r in range(len(xs))]
    if isinstance(module, TpGather):
        return [torch.cat(_own(xs, r), dim=module.dim) for r in range(len(xs))]
    if isinstance(module, TpScatter):
        return _scatter(xs, module.dim)
    if isinstance(module, TpGroupGradSum):
        return _group_copy(xs, module)
    raise NotImplementedError(f"the lockstep runner has no emulation of {type(module).__name__}")


def _stage(gms: list[fx.GraphModule], args: list[list], sent: dict) -> list:
    """Run one stage's tp graphs node by node; every rank's output."""
    interps = [fx.Interpreter(gm) for gm in gms]
    for interp, a in zip(interps, args):
        interp.env = {}
        interp.args_iter = iter(a)
    columns = [list(gm.graph.nodes) for gm in gms]
    assert all([n.name for n in c] == [n.name for n in columns[0]] for c in columns), "ranks' graphs differ"
    outputs = [None] * len(gms)
    for row in zip(*columns):
        modules = [gm.get_submodule(n.target) if n.op == "call_module" else None for gm, n in zip(gms, row)]
        if isinstance(modules[0], (SendActivation, RecvActivation)):
            for t, (i, n) in enumerate(zip(interps, row)):
                if isinstance(modules[0], RecvActivation):
                    i.env[n] = sent[(modules[0].edge, t)]
                else:
                    sent[(modules[0].edge, t)] = i.env[n] = i.env[n.args[0]]
        elif isinstance(modules[0], VocabParallelCrossEntropy):
            values = [[i.env[a] for a in n.args] for i, n in zip(interps, row)]
            for i, n, v in zip(interps, row, _vocab_ce(values, modules)):
                i.env[n] = v
        elif isinstance(modules[0], GraphCollective):
            values = [[i.env[a] for a in n.args] for i, n in zip(interps, row)]
            for i, n, v in zip(interps, row, _collective(modules[0], values)):
                i.env[n] = v
        else:
            for t, (i, n) in enumerate(zip(interps, row)):
                value = i.run_node(n)
                if n.op == "output":
                    outputs[t] = value
                else:
                    i.env[n] = value
    return outputs


def run_train(result, inputs: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
    """Forward and backward of dp replica 0 of an :func:`autopar.plan` result (every tp rank, every stage in
    order, one microbatch ``inputs``): (each tp rank's loss, each tp rank's {parameter name: gradient})."""
    tp = result.plan.mesh.tp
    num_stages = len(result.lowered[0].stages)
    sent, outputs, params = {}, None, [dict() for _ in range(tp)]
    with torch.enable_grad():
        for stage in range(num_stages):
            graphs = [result.lowered[t].stages[stage] for t in range(tp)]
            for t, g in enumerate(graphs):
                params[t].update(g.gm.named_parameters())
            args = [[inputs[name] for name in g.input_names] for g in graphs]
            outputs = _stage([g.gm for g in graphs], args, sent)
        losses = [out[0] if isinstance(out, (tuple, list)) else out for out in outputs]
        flat = [(t, name, p) for t in range(tp) for name, p in params[t].items()]
        grads = torch.autograd.grad(losses, [p for _, _, p in flat], grad_outputs=[torch.ones_like(x) for x in losses],
                                    allow_unused=True)
    per_rank = [dict() for _ in range(tp)]
    for (t, name, p), g in zip(flat, grads):
        per_rank[t][name] = torch.zeros_like(p) if g is None else g
    return [loss.detach() for loss in losses], per_rank


def shard_of(full: torch.Tensor, spec, *, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` under a :class:`~autopar.plan_model.ParamShard` as its docstring
    defines it (None: the whole tensor): equal ``chunks`` (or unequal ``blocks`` of (size, parts)) along
    ``dim``, each cut ``parts`` ways (0: ``size`` ways), rank r holding piece ``r * parts // size``."""
    if spec is None:
        return full
    blocks = spec.blocks or tuple((full.shape[spec.dim] // spec.chunks, spec.parts) for _ in range(spec.chunks))
    pieces, offset = [], 0
    for length, parts in blocks:
        block = full.narrow(spec.dim, offset, length)
        ways = parts or size
        pieces.append(block.chunk(ways, spec.dim)[rank * ways // size])
        offset += length
    return torch.cat(pieces, dim=spec.dim)
