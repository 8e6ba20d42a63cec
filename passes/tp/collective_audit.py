"""The collective audit: every communication a rewritten graph does, with its bytes, per block.

Reads a stage graph after the tensor-parallel passes: each collective node (an autopar
:class:`~autopar.ops.collectives.GraphCollective`) says what it runs forward and backward
(``comm``), and ``autopar.tensor`` gives the bytes of its input and output. ``nbytes`` is the
size of the *full* tensor a collective works on (b·s·h·4 for a block's fp32 activations), the
figure the analytic counts use; :func:`wire_bytes` turns it into what one rank sends with ring
algorithms.

Example::

    >>> import autopar
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> result = autopar.plan(model, (1, 1, 2), example_inputs=(x,), loss_fn=loss_fn, example_target=y)
    >>> records = audit_collectives(result.graph(0))
    >>> per_unit(records)["model.blocks.0"]
    {('backward', 'all_reduce'): (2, 16384), ('forward', 'all_reduce'): (2, 16384)}
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.ir.meta_keys import MODULE, TENSOR, get_meta
from autopar.ops.collectives import GraphCollective

__all__ = ["CollectiveRecord", "audit_collectives", "per_unit", "wire_bytes", "format_audit"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective one node runs per call (a microbatch's forward or backward)."""

    node: str
    module: str  # the collective's class name
    path: str  # module path of the model code it belongs to
    unit: str  # pipeline unit (block) of that code
    direction: str  # 'forward' or 'backward'
    op: str  # 'all_reduce', 'all_gather' or 'reduce_scatter'
    nbytes: int  # bytes of the full tensor
    size: int  # ranks in the group
    recompute: bool = False  # an all-gather repeated in backward to avoid storing its output


def _nbytes(node) -> int:
    info = get_meta(node, TENSOR) if isinstance(node, fx.Node) else None
    return info.nbytes if info is not None else 0


def audit_collectives(gm: fx.GraphModule) -> list[CollectiveRecord]:
    """Every collective of ``gm``, in graph order (forward first, then each node's backward)."""
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, GraphCollective):
            continue
        info = get_meta(node, MODULE)
        in_bytes = _nbytes(node.args[0]) if node.args else 0
        for comm in module.comm(in_bytes, _nbytes(node)):
            records.append(CollectiveRecord(node.name, type(module).__name__, info.path if info else "",
                                            info.unit if info else "", comm.direction, comm.op, comm.nbytes,
                                            module.size, comm.recompute))
    return records


def per_unit(records: list[CollectiveRecord], *, recompute: bool = False) -> dict[str, dict]:
    """{unit: {(direction, op): (count, bytes of each)}}; recompute all-gathers only if asked."""
    table: dict[str, dict] = {}
    for r in records:
        if r.recompute and not recompute:
            continue
        key = (r.direction, r.op + (" (recompute)" if r.recompute else ""))
        count, nbytes = table.setdefault(r.unit, {}).get(key, (0, r.nbytes))
        if nbytes != r.nbytes:
            nbytes = -1  # mixed sizes: no single figure
        table[r.unit][key] = (count + 1, nbytes)
    return table


def wire_bytes(record: CollectiveRecord) -> int:
    """Bytes one rank sends for ``record`` with ring algorithms (all-reduce twice a gather's)."""
    share = record.nbytes * (record.size - 1) // record.size
    return 2 * share if record.op == "all_reduce" else share


def format_audit(records: list[CollectiveRecord]) -> str:
    """One line per record: unit, node, direction, op, bytes."""
    return "\n".join(f"{r.unit or '<root>':<22} {r.node:<24} {r.direction:<8} {r.op:<15} "
                     f"{r.nbytes:>10} B{' (recompute)' if r.recompute else ''}" for r in records)
