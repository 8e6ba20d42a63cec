"""Tensor-parallel placement rules of grouped expert products (``grouped_mm``), as data.

A mixture-of-experts layer with 3-D fused expert weights (transformers 5.x's ``MixtralExperts``:
``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) runs each expert's MLP as one grouped
matrix product over the tokens sorted by expert: ``grouped_mm(x [T, K], w [E, K, N], offs)``
-> [T, N] (``torch._grouped_mm``, ``F.grouped_mm``, or transformers' own
``transformers::grouped_mm_fallback`` where those have no kernel). Its rule is a linear's, per
expert: ``w`` sharded on N (every expert's columns) gives an output sharded on its last dim;
``x`` sharded on its last dim with ``w`` sharded on K (every expert's rows) gives a partial sum.
:data:`EXPERT_RULES` is registered at the end of :data:`autopar.passes.tp_rules.RULES`.
"""
from __future__ import annotations

from types import MappingProxyType

import torch.fx as fx

from autopar.passes.meta_keys import Placement
from autopar.passes.tp_errors import NoRule

__all__ = ["EXPERT_RULES", "EXPERT_PRODUCTS", "grouped_mm"]

EXPERT_PRODUCTS = ("grouped_mm_fallback", "_grouped_mm", "grouped_mm")


def _no_rule(message: str):
    return NoRule(message)


def grouped_mm(node: fx.Node, placed: dict):
    """x [T, K] @ w [E, K, N] per expert group: column (w on N) -> S(1), row (x on K, w on K) -> P."""
    x, w = node.args[0], node.args[1]
    px, pw = placed.get(x), placed.get(w)
    if pw is not None and pw.kind == "S" and pw.dim == 2 and px is None:
        return Placement("S", 1, pw.chunks), {x: Placement("R"), w: pw}
    if px is not None and px == Placement("S", 1) and (pw is None or pw == Placement("S", 1)):
        return Placement("P"), {x: px, w: Placement("S", 1)}
    raise _no_rule(f"{node.name}: grouped product of x {px} and weight {pw} is neither an expert column "
                   "(weight sharded on its output dim) nor an expert row (both sharded on the contracted dim)")


EXPERT_RULES: "MappingProxyType[str, object]" = MappingProxyType({name: grouped_mm for name in EXPERT_PRODUCTS})
