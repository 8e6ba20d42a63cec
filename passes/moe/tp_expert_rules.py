"""Tensor-parallel placement rules of grouped expert products (``grouped_mm``), as data.

A mixture-of-experts layer with 3-D fused expert weights (transformers 5.x's ``MixtralExperts``:
``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) runs each expert's MLP as one grouped
matrix product over the tokens sorted by expert: ``grouped_mm(x [T, K], w [E, K, N], offs)``
-> [T, N] (``torch._grouped_mm``, ``F.grouped_mm``, or transformers' own
``transformers::grouped_mm_fallback`` where those have no kernel). Its rule is a linear's, per
expert: ``w`` sharded on N (every expert's columns) gives an output sharded on its last dim;
``x`` sharded on its last dim with ``w`` sharded on K (every expert's rows) gives a partial sum.
:data:`EXPERT_RULES` is registered at the end of :data:`autopar.passes.tp.tp_rules.RULES`.

Experts gathered by id (``bmm(x [R, 1, K], w[ids] [R, K, N])``: each row multiplied by its own expert's
matrix, the plain-torch fused form ``autopar.models.moe``) follow the same rule:
:func:`expert_product` reads the operands' ranks, so one rule serves both. The expert finder
(:mod:`autopar.passes.moe.tp_expert`) applies it to a ``bmm``/``matmul`` only when its weight is a 3-D
parameter indexed by expert id; every other ``bmm`` keeps the batched rule of ``tp_rules``.
(transformers' ``batched_mm`` experts multiply ``w[ids] @ x``, the weight first: not matched, they stay
replicated over tp.)
"""
from __future__ import annotations

from types import MappingProxyType

import torch.fx as fx

from autopar.ir.meta_keys import TENSOR, Placement, get_meta
from autopar.passes.tp.tp_errors import NoRule

__all__ = ["EXPERT_RULES", "EXPERT_PRODUCTS", "GATHERED_PRODUCTS", "grouped_mm", "expert_product"]

EXPERT_PRODUCTS = ("grouped_mm_fallback", "_grouped_mm", "grouped_mm")
GATHERED_PRODUCTS = ("bmm", "matmul")  # expert products when the weight is a 3-D parameter indexed by id


def _no_rule(message: str):
    return NoRule(message)


def _rank(node) -> int:
    info = get_meta(node, TENSOR) if isinstance(node, fx.Node) else None
    if info is None or info.shape is None:
        raise _no_rule(f"no shape recorded for {node}")
    return len(info.shape)


def expert_product(node: fx.Node, placed: dict):
    """x [.., K] @ w [.., K, N] per expert: column (w on N) -> output on its last dim; row (x on K, w on K) -> P."""
    x, w = node.args[0], node.args[1]
    px, pw = placed.get(x), placed.get(w)
    rx, rw, out = _rank(x), _rank(w), _rank(node)
    if pw is not None and pw.kind == "S" and pw.dim == rw - 1 and px is None:
        return Placement.shard(out - 1, pw.chunks), {x: Placement("R"), w: pw}
    if px is not None and px == Placement.shard(rx - 1) and (pw is None or pw == Placement.shard(rw - 2)):
        return Placement("P"), {x: px, w: Placement.shard(rw - 2)}
    raise _no_rule(f"{node.name}: expert product of x {px} and weight {pw} is neither an expert column "
                   "(weight sharded on its output dim) nor an expert row (both sharded on the contracted dim)")


grouped_mm = expert_product  # x [T, K] @ w [E, K, N] per expert group: column -> S(1), row -> P

EXPERT_RULES: "MappingProxyType[str, object]" = MappingProxyType({name: grouped_mm for name in EXPERT_PRODUCTS})
