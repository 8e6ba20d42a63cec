"""Activation memory: bytes one microbatch's forward keeps for backward, and the schedule's peak.

:func:`stage_activations` runs a stage graph's forward once on *fake* tensors (no memory is
allocated; a 70B-shaped stage runs in well under a second) under autograd, with
``torch.autograd.graph.saved_tensors_hooks`` recording every storage autograd saves — the same
:class:`~autopar.runtime.diagnostics.memory_probe.SavedLedger` the runtime probe uses on real tensors. So the
figure follows the actual kernels (the CPU flash attention keeps q, k, v, out and the logsumexp,
never the s×s scores), views share their base's storage, and the recompute regions count what
they hold (inputs; for selective, the stored matmul outputs). Parameters, buffers and the batch
inputs are not activations.

Collectives and p2p nodes run as fakes with the same autograd footprint as the real ones
(``TpCopy`` a view, ``TpReduce`` a copy, ``recv`` a fresh tensor, ``send`` nothing).

A stage graph with symbolic dims (a sequence of any length, docs/batches.md) runs at ``sizes``
({symbol: size}, the bound by default): the figure is that of the longest batch the plan takes.

The *transient* of a recompute region is what its recomputation materialises again in backward
(its saved storages minus those it holds anyway); one region recomputes at a time.

:func:`peak_bytes` walks a rank's action list: each F adds its stage's bytes, the releasing
action (B, or W when backward is split) removes them — the weighted version of the simulator's
``peak_activations``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.ir.meta_keys import TENSOR, get_meta
from autopar.ops.collectives import GraphCollective
from autopar.ops.context_parallel.ulysses import ulysses_plain
from autopar.ops.p2p import P2PNode, SendActivation
from autopar.ops.recompute import Recompute
from autopar.runtime.diagnostics.memory_probe import SavedLedger
from autopar.runtime.schedules.action import ActionKind

__all__ = ["StageActivations", "stage_activations", "peak_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageActivations:
    """Per microbatch: bytes held for backward, and the largest recompute transient.

    ``pieces``: the bytes of each saved storage, in the order the forward saved them (they sum to
    ``saved``); ``regions``: per recompute region met, in order, the pieces its plain run saves and
    the pieces it holds (its transient is their difference). :mod:`autopar.memory.formula` reads
    them at two shapes to write each piece as a monomial of the microbatch size and sequence length.
    """

    saved: int
    transient: int = 0
    pieces: tuple[int, ...] = ()
    regions: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()


class _FakeRun(fx.Interpreter):
    """Interprets a stage graph on fake tensors with autograd on, for the saved-tensor ledger."""

    def __init__(self, gm: fx.GraphModule, *, mode: FakeTensorMode, ledger: SavedLedger, fakes: dict,
                 transients: dict, seen: dict, sizes: dict | None = None):
        super().__init__(gm)
        self.mode, self.ledger, self.fakes, self.sizes = mode, ledger, fakes, sizes or {}
        # {region key: (bytes, (plain pieces, held pieces))} (memo), keys met in this stage (a dict: in order)
        self.transients, self.seen = transients, seen

    def get_attr(self, target, args, kwargs):
        real = super().get_attr(target, args, kwargs)
        if id(real) not in self.fakes:
            with self.mode:
                fake = torch.empty_strided(tuple(real.shape), tuple(real.stride()), dtype=real.dtype)
            if isinstance(real, torch.nn.Parameter) and real.requires_grad:
                fake.requires_grad_()
            self.fakes[id(real)] = fake
            self.ledger.exclude([fake])
        return self.fakes[id(real)]

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        if isinstance(module, Recompute):
            return self._region(module, args)
        if isinstance(module, P2PNode):
            if isinstance(module, SendActivation):
                return args[0].new_zeros(())
            out = torch.empty(module.shape_at(self.sizes), dtype=module.dtype)
            return out.requires_grad_() if module.requires_grad else out
        if isinstance(module, GraphCollective):
            return self._collective(module, args)
        return super().call_module(target, args, kwargs)

    def _collective(self, module, args):
        name = type(module).__name__
        if name == "TpCopy":
            return args[0].view_as(args[0])
        if name == "TpReduce":
            return args[0].clone()
        out = module.meta_forward(*args)
        if name == "ZeroGather":  # gathered weights are freed after use: parameters, not activations
            self.ledger.exclude(out)
        if name not in _SAVES and name not in _SAVES_NOTHING:
            log.warning("memory calculator: what %s saves for backward is not modelled; counted as nothing", name)
        saved = _SAVES[name](module, *args) if name in _SAVES else []
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not inputs:
            return out
        if isinstance(out, (tuple, list)):
            return type(out)(_Saves.apply(t, len(saved), *saved, *inputs) if t.is_floating_point() else t
                             for t in out)
        return _Saves.apply(out, len(saved), *saved, *inputs)

    def _region(self, module: Recompute, args):
        body = _FakeRun(module.body, mode=self.mode, ledger=self.ledger, fakes=self.fakes,
                        transients=self.transients, seen=self.seen, sizes=self.sizes)
        held = SavedLedger()
        held.excluded = self.ledger.excluded

        def observe(tensors):
            self.ledger.hold(tensors)
            held.hold(tensors)

        module.observer = observe
        try:
            out = module.run(body.run, *args)
        finally:
            module.observer = None
        key = (module.mode, _structure(module.body), tuple((tuple(a.shape), a.dtype, a.requires_grad)
                                                          for a in args if isinstance(a, torch.Tensor)))
        if key not in self.transients:  # identical blocks recompute identically: run one of them plainly
            plain = SavedLedger()  # the region run plainly: what its recomputation materialises again
            plain.excluded = self.ledger.excluded
            with plain.watch():
                _FakeRun(module.body, mode=self.mode, ledger=plain, fakes=self.fakes, transients={},
                         seen={}, sizes=self.sizes).run(*args)
            self.transients[key] = (max(0, plain.total() - held.total()), (plain.sizes(), held.sizes()))
        self.seen[key] = None
        return out


class _Saves(torch.autograd.Function):
    """Fake of a communicating op's autograd node: passes ``out`` through, saves ``saved`` for backward."""

    @staticmethod
    def forward(ctx, out, num_saved, *tensors):
        ctx.save_for_backward(*tensors[:num_saved])  # the rest are the op's inputs: they connect the graph
        ctx.num_inputs = len(tensors)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + (None,) * ctx.num_inputs


def _vocab_cross_entropy_saves(logits, target):
    """ops/tp_ops.py: the fp32 softmax of the shard, the local targets and three row masks/counts."""
    rows = tuple(logits.shape[:-1])
    return [torch.empty(tuple(logits.shape), dtype=torch.float32), torch.empty(rows, dtype=torch.long),
            torch.empty(rows, dtype=torch.bool), torch.empty(rows, dtype=torch.bool), torch.empty((), dtype=torch.long)]


def _ring_saves(q, k, v, bias=None, docs=None, valid=None):
    """ops/context_parallel/ring.py: q, k, v (the rank's shards), the bias and document ids, the output and the
    fp32 log-sum-exp of every query (blocks are recomputed in backward: nothing of size seq x seq is kept)."""
    kept = [t for t in (q, k, v, bias, docs) if t is not None]
    return kept + [torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype),
                   torch.empty(tuple(q.shape[:-1]), dtype=torch.float32)]


def _ulysses_saves(module, q, k, v, bias=None, docs=None, valid=None):
    """ops/context_parallel/ulysses.py: the all-to-alls save nothing; the attention of the rank's heads over the
    whole sequence keeps q, k, v, the output and the log-sum-exp as ring.py's blockwise kernel does (a plain
    causal one: one SDPA over the sequence put in global order, which keeps them too, and the orders' indices)."""
    size, seq = module.size, module.layout.seq_len

    def heads(t):  # [B, H, L, D] -> [B, H/cp, cp*L, D] (fewer kv heads than cp: repeated, one per rank)
        return torch.empty((t.shape[0], max(t.shape[1] // size, 1), seq, t.shape[-1]), dtype=t.dtype)

    if bias is not None and bias.shape[2] > 1:  # every query's rows arrive by an all-to-all or a gather
        bias = torch.empty((bias.shape[0], bias.shape[1] // size if bias.shape[1] > 1 else 1, seq, bias.shape[3]),
                           dtype=bias.dtype)
    gathered = None if docs is None else torch.empty((docs.shape[0], seq), dtype=docs.dtype)
    kept = _ring_saves(heads(q), heads(k), heads(v), bias, gathered)
    if size > 1 and ulysses_plain(module.spec, q, v, bias, docs, valid):  # one SDPA over the sequence in global
        kept += [torch.empty((seq,), dtype=torch.int64) for _ in range(2)]  # order: the two permutations' indices
    return kept


#: What each communicating module's autograd node saves (autopar's own ops; their code is the source).
_SAVES = {
    "VocabParallelCrossEntropy": lambda module, logits, target: _vocab_cross_entropy_saves(logits, target),
    "SpGatherLinear": lambda module, x, *weights_and_biases: [x],  # the sequence shard, gathered again in backward
    "RingAttention": lambda module, *args: _ring_saves(*args),
    "UlyssesAttention": _ulysses_saves,
}
_SAVES_NOTHING = ("SpAllGather", "SpReduceScatter", "TpGather", "TpScatter", "ZeroGather", "ZeroFree")


def _structure(gm: fx.GraphModule) -> tuple:
    """A region's graph up to node names: its ops (modules by type), their arguments and output shapes."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def arg(a):
        return ("node", index[a]) if isinstance(a, fx.Node) else repr(a)

    rows = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            module = gm.get_submodule(n.target)
            what = (type(module).__name__, getattr(module, "requires_grad", None))
        elif n.op == "get_attr":
            what = getattr(_attr(gm, n.target), "requires_grad", False)  # names differ between stages
        else:
            what = "" if n.op == "placeholder" else str(n.target)
        info = get_meta(n, TENSOR)
        rows.append((n.op, what, tuple(fx.node.map_aggregate(n.args, arg)),
                     (info.shape, info.dtype) if info else None))
    return tuple(rows)


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _placeholder_fakes(gm: fx.GraphModule, mode: FakeTensorMode, resized: dict) -> list:
    fakes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        info = get_meta(node, TENSOR)
        shape = None if info is None or info.shape is None else [
            resized.get((node.name, d), size) for d, size in enumerate(info.shape)]
        with mode:
            fakes.append(torch.empty(shape, dtype=info.dtype) if shape is not None else None)
    return fakes


def stage_activations(gm: fx.GraphModule, *, memo: dict | None = None, dynamic: tuple = (),
                      sizes: dict | None = None) -> StageActivations:
    """Bytes one microbatch's forward of stage graph ``gm`` saves for backward (a fake run).

    ``memo`` (a dict shared across calls) reuses the figures of structurally identical stages and
    recompute regions (the middle stages of a deep model), so the cost follows distinct stages.
    ``dynamic``: the graph's symbolic dims (``StageGraph.dynamic``), run at ``sizes`` ({symbol: size}).
    """
    memo = {} if memo is None else memo
    resized = {pair: sizes[d.symbol] for d in dynamic if d.symbol in (sizes or {}) for pair in d.inputs}
    key = ("stage", _structure(gm), tuple(sorted(resized.items())))
    if key not in memo:
        memo[key] = _stage_activations(gm, transients=memo.setdefault("regions", {}), resized=resized,
                                       sizes=sizes or {})
    return memo[key]


def _stage_activations(gm: fx.GraphModule, *, transients: dict, resized: dict, sizes: dict) -> StageActivations:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ledger, seen = SavedLedger(), {}
    inputs = _placeholder_fakes(gm, mode, resized)
    ledger.exclude(inputs)
    with mode, torch.enable_grad(), ledger.watch():
        _FakeRun(gm, mode=mode, ledger=ledger, fakes={}, transients=transients, seen=seen,
                 sizes=sizes).run(*inputs)
    return StageActivations(saved=ledger.total(), transient=max((transients[k][0] for k in seen), default=0),
                            pieces=ledger.sizes(), regions=tuple(transients[k][1] for k in seen))


def peak_bytes(row, per_stage: dict[int, int], *, split_backward: bool) -> int:
    """Most activation bytes a rank running ``row`` holds at once (right after an F)."""
    release = ActionKind.W if split_backward else ActionKind.B
    held = peak = 0
    for action in row:
        if action.kind is ActionKind.F:
            held += per_stage[action.stage]
            peak = max(peak, held)
        elif action.kind is release:
            held -= per_stage[action.stage]
    return peak
