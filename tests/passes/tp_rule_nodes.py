"""Hand-made fx nodes for the unit tests of the tensor-parallel placement rules (passes/tp/tp_rules.py):
placeholders and calls with a recorded shape, and a node's rule applied to given input placements."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, Placement, TensorInfo, set_meta
from autopar.passes.tp.tp_rules import rule_for

R = Placement("R")
P = Placement("P")
S = Placement.shard


def make_input(graph: fx.Graph, shape):
    """A placeholder of ``shape`` (None: no shape recorded)."""
    x = graph.placeholder(f"x{len(graph.nodes)}")
    if shape is not None:
        set_meta(x, TENSOR, TensorInfo(tuple(shape), torch.float32, 0))
    return x


def make_call(graph: fx.Graph, target, args, shape, **kwargs):
    """``target(*args, **kwargs)`` with output ``shape`` (None: no shape recorded)."""
    node = graph.call_function(target, tuple(args), kwargs)
    if shape is not None:
        set_meta(node, TENSOR, TensorInfo(tuple(shape), torch.float32, 0))
    return node


def apply_rule(node, placed):
    """The rule of ``node``'s op applied: (its placement, the placements it asks of its inputs)."""
    return rule_for(node)(node, placed)
