"""Random ops in sharded regions draw from a per-tp-rank stream (Megatron's RNG tracker).

A dropout on a shard (attention probabilities of this rank's heads, a sequence-parallel shard of
the residual stream) must draw a different mask on every tp rank, and must not advance the
default generator that the replicated regions share. Each such op becomes a
:class:`~autopar.ops.tp_rng.ShardedRandom` node running on this rank's
:class:`~autopar.ops.tp_rng.TpRngTracker` (seeded ``seed + 2718 + tp_rank``); random ops in
replicated regions are left alone and draw the same masks on every rank, as one device would.

Example::

    >>> import torch
    >>> from autopar.models import build_model, lm_loss
    >>> from autopar.passes.frontend.annotate import annotate
    >>> from autopar.passes.frontend.capture import capture
    >>> from autopar.passes.tp.tensor_parallel import shard_tensor_parallel
    >>> model = build_model("gpt_tiny", dropout=0.1)
    >>> x = y = torch.zeros(8, 16, dtype=torch.long)
    >>> gm = capture(model, (x,), loss_fn=lm_loss, example_target=y).gm
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> from autopar.passes.lowering_state import LoweringState
    >>> from autopar.passes.tp.tp_select import select_tp_regions
    >>> from autopar.plan_model import MeshShape
    >>> st = select_tp_regions(LoweringState.of_graph(gm, mesh=MeshShape(tp=2), tp_rank=1))
    >>> st = fork_sharded_random(shard_tensor_parallel(st))
    >>> [n.target for n in st.gm.graph.nodes if n.op == "call_module" and n.target.startswith("tp_random")][:1]
    ['tp_random_0']
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from autopar.ir.meta_keys import MODULE, TP_PLACEMENT, get_meta
from autopar.ops.tp_rng import ShardedRandom, TpRngTracker, tp_rng_seed
from autopar.passes.lowering_state import LoweringState
from autopar.passes.tp.tp_rules import op_name

__all__ = ["fork_sharded_random", "is_random", "RANDOM_OPS"]

log = logging.getLogger(__name__)

RANDOM_OPS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli",
                        "rand_like", "randn_like", "randint_like", "scaled_dot_product_attention"})


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def is_random(node: fx.Node) -> bool:
    """Does ``node`` draw random numbers (a training-mode dropout, attention with dropout_p > 0, ...)?"""
    if node.op != "call_function" or op_name(node) not in RANDOM_OPS:
        return False
    name = op_name(node)
    if name == "scaled_dot_product_attention":
        return _arg(node, 4, "dropout_p", 0.0) > 0
    if name in ("dropout", "feature_dropout", "alpha_dropout", "native_dropout"):
        return _arg(node, 1, "p", 0.5) > 0 and _arg(node, 2, "train", True) is not False
    return True


def fork_sharded_random(st: LoweringState) -> LoweringState:
    """Run every random op whose output is sharded on this rank's own stream (seeded from
    ``torch.initial_seed()``); the state as it was when the graph draws no random numbers."""
    gm = st.gm
    if not any(is_random(n) for n in gm.graph.nodes):
        return st
    tracker = TpRngTracker(seed=tp_rng_seed(torch.initial_seed(), st.tp_rank))
    count = 0
    for node in list(gm.graph.nodes):
        placement = get_meta(node, TP_PLACEMENT)
        if not is_random(node) or placement is None or placement.kind != "S":
            continue
        name = f"tp_random_{count}"
        count += 1
        gm.add_submodule(name, ShardedRandom(node.target, tracker=tracker))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, node.args, node.kwargs)
        new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", MODULE, TP_PLACEMENT)})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    log.info("tensor parallel: %d random ops on the per-rank stream (seed %d)", count, tracker.seed)
    return dataclasses.replace(st, gm=gm)
