"""Analyses: what tensor parallelism shards on this graph, as the given Plan says, else what is found.

Three analysis passes of the lowering (``autopar/lowering.py``), each placed right before the
transform that reads it and found on the graph that transform rewrites, so no result refers to a
node an earlier transform replaced:

- :func:`select_vocab_parallel`: the embedding, LM head and loss to shard on the vocabulary
  (:func:`~autopar.passes.tp.vocab_parallel.find_vocab_parallel`); with a given Plan only if it names them;
- :func:`select_tp_regions`: the Megatron regions (:func:`~autopar.passes.tp.tp_regions.find_tp_regions`,
  the LM head left to the vocabulary pass); with a given Plan those it names; and a warning for each
  weight product no rule covers (:func:`~autopar.passes.tp.tp_coverage.warn_unsharded_matmuls`);
- :func:`select_expert_regions`: the expert MLPs sharded over tp
  (:func:`~autopar.passes.moe.tp_expert.find_expert_regions`); with a given Plan those whose weights it shards.

Each leaves the state as it was when tensor parallelism is off (tp=1 or ``tensor_parallel=False``).
"""
from __future__ import annotations

import dataclasses

from autopar.ir.graph_names import user_name
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.passes.lowering_state import LoweringState
from autopar.passes.tp.tp_coverage import warn_unsharded_matmuls
from autopar.passes.moe.tp_expert import find_expert_regions
from autopar.passes.tp.tp_regions import TpRegion, find_tp_regions
from autopar.passes.tp.vocab_parallel import VocabParallel, find_vocab_parallel
from autopar.plan_model import TpRegionPlan

__all__ = ["select_vocab_parallel", "select_tp_regions", "select_expert_regions", "region_plan", "tp_on"]


def tp_on(st: LoweringState) -> bool:
    """Does tensor parallelism shard anything here: tp > 1 and the ``tensor_parallel`` option on?"""
    return st.plan.mesh.tp > 1 and st.options.tensor_parallel


def region_plan(region: TpRegion) -> TpRegionPlan:
    """A region as the Plan records it: its columns, rows and gathered columns by module path."""
    def paths(nodes):
        return tuple(user_name(get_meta(n, MODULE).path) for n in nodes)
    return TpRegionPlan(columns=paths(region.columns), rows=paths(region.rows), gathered=paths(region.gathers))


def select_vocab_parallel(st: LoweringState) -> LoweringState:
    """``vocab``: the embedding, head and loss to shard on the vocabulary, as the given Plan says, else where
    the vocabulary divides by tp (required with ``vocab_parallel=True``, none with ``False``)."""
    wanted = st.options.vocab_parallel
    if not tp_on(st) or wanted is False or (st.pinned and not st.plan.vocab_parallel):
        return dataclasses.replace(st, vocab=VocabParallel())
    return dataclasses.replace(st, vocab=find_vocab_parallel(st.gm, tp_size=st.plan.mesh.tp, strict=wanted is True))


def select_tp_regions(st: LoweringState) -> LoweringState:
    """``regions`` (and ``region_plans``): the tensor-parallel regions, those the given Plan names or every one
    found (the vocabulary pass's head left out); a warning names each weight product left replicated."""
    if not tp_on(st):
        return st
    head = st.vocab.head if st.vocab else None
    regions = find_tp_regions(st.gm, skip=[head] if head is not None else [], tp_size=st.plan.mesh.tp)
    if st.pinned:
        wanted = {r.columns for r in st.plan.tp_regions}
        regions = [r for r in regions if region_plan(r).columns in wanted]
    warn_unsharded_matmuls(st.gm)  # weight products no rule covers stay replicated: say so
    return dataclasses.replace(st, regions=tuple(regions), region_plans=tuple(region_plan(r) for r in regions))


def select_expert_regions(st: LoweringState) -> LoweringState:
    """``expert_regions``: the expert MLPs to shard over tp; with a given Plan, those whose weights it shards."""
    if not tp_on(st):
        return st
    regions = find_expert_regions(st.gm)
    if st.pinned:
        regions = [r for r in regions if all(user_name(t) in st.plan.param_shards for t in r.specs)]
    return dataclasses.replace(st, expert_regions=tuple(regions))
