"""The model as the planner sees it: per-chunk costs, measured once on the captured graph.

A *chunk* is the smallest piece a pipeline stage is made of: the code before the first block
together with block 0, each later block, and the code after the last block (a stage may begin
only at a block or right after the last one; see :mod:`autopar.passes.pipeline.partition`). For every
tensor-parallel degree the planner considers, :func:`profile_model` shards the captured graph
(the compiler's own passes), cuts it into one stage per chunk, and reads per sample:

- forward FLOPs, graph ops, matrix products and bytes written (``autopar.cost``, ``autopar.tensor``);
- the chunk's parameters as this tp rank holds them (:func:`autopar.memory.states.rank_params`);
- bytes saved for backward with each recompute mode, and the recompute transient
  (:func:`autopar.memory.stage_activations`, a fake run);
- each collective and its bytes (:func:`autopar.passes.tp.collective_audit.audit_collectives`);
- the bytes a stage beginning at the chunk receives (its recv edges);
- its MoE layers (:class:`MoeCost`: experts, top-k, expert tensors, the bytes of the routed rows
  an all-to-all would move), from :func:`autopar.passes.moe.moe_detect.find_moe_layers` on the graph
  captured with its experts whole (``expert_parallel=1``).

The model is captured once, at one sample per microbatch, its sequences padded to the bound the
batches may reach (``max_seq_len``, else the model's own maximum; docs/batches.md), and with its
identical blocks captured once (:mod:`autopar.passes.frontend.block_template`): the template block's chunk
stands for every block, so an 80-layer model costs what a 3-layer one does. Costs scale linearly with the microbatch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from autopar.errors import AutoparError, PlanError
from autopar.ir.meta_keys import COST, TENSOR, get_meta
from autopar.lowering import Captured, capture_and_annotate, shard_captured, user_name
from autopar.memory.activations import stage_activations
from autopar.memory.states import ParamEntry, rank_params
from autopar.options import CompileOptions, resolve_plan
from autopar.passes.context_parallel.attention import find_attention
from autopar.passes.tp.collective_audit import audit_collectives
from autopar.passes.moe.moe_detect import find_moe_layers
from autopar.passes.pipeline.partition import _allowed_starts, cut_stages, pipeline_segments
from autopar.passes.pipeline.pipeline_split import split_graph
from autopar.passes.pipeline.recompute import recompute_stage
from autopar.passes.frontend.seq_bounds import model_max_length, padded_to
from autopar.plan_model import MeshShape

__all__ = ["CommCost", "MoeCost", "ChunkCost", "ModelProfile", "profile_model", "RECOMPUTE"]

log = logging.getLogger(__name__)

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class CommCost:
    """One collective of a chunk per microbatch: direction, op, bytes per sample, recomputed or not."""

    direction: str
    op: str
    nbytes: float
    recompute: bool = False


@dataclass(frozen=True)
class MoeCost:
    """One recognised MoE layer of a chunk (:mod:`autopar.passes.moe.moe_detect`), per sample of the microbatch.

    ``dispatch_bytes``: the routed rows (tokens x top-k) entering the first expert matmul, x hidden x
    bytes, what the dispatch all-to-all moves; ``combine_bytes``: the rows leaving the last one (the
    combine's). ``expert_params``: the user names of the 3-D expert tensors split over ep.
    """

    path: str
    form: str
    num_experts: int
    top_k: int
    dispatch_bytes: float
    combine_bytes: float
    expert_params: tuple[str, ...]


@dataclass(frozen=True)
class ChunkCost:
    """One chunk on one tp rank; every size is per sample of the microbatch."""

    unit: str  # the unit a stage starting here begins with (user name, as Plan.stage_starts spells it)
    is_block: bool
    flops: float
    ops: int
    bytes_written: float
    params: tuple[ParamEntry, ...]
    buffer_bytes: int
    saved: dict  # recompute mode -> bytes kept for backward per sample
    transient: dict  # recompute mode -> largest recomputation transient per sample
    comms: tuple[CommCost, ...]
    recv_bytes: float  # bytes a stage starting at this chunk receives per sample
    moe: tuple[MoeCost, ...] = ()  # the MoE layers whose experts this chunk holds
    gemms: int = 0  # matrix products (nodes with FLOPs: linears, batched products, attention) per microbatch
    attention_kv: float = 0.0  # bytes of K and V of the chunk's attentions per sample (cp's ring passes them on)
    attention_qo: float = 0.0  # bytes of Q and of the output of the chunk's attentions per sample (cp's all-to-all)
    attention_heads: int = 0  # the fewest query heads (on this tp rank) of the chunk's attentions; 0: none

    @functools.cached_property
    def param_numel(self) -> int:
        """Elements of the chunk's parameters (the planner's memory-aware stage cuts read it for every candidate)."""
        return sum(p.numel for p in self.params)

    def renamed(self, old: str, new: str) -> "ChunkCost":
        """The same chunk for another block (``old`` -> ``new`` in unit and parameter names)."""
        def swap(name: str) -> str:
            return new + name[len(old):] if name == old or name.startswith(old + ".") else name
        params = tuple(dataclasses.replace(p, name=swap(p.name)) for p in self.params)
        moe = tuple(dataclasses.replace(m, path=swap(m.path), expert_params=tuple(map(swap, m.expert_params)))
                    for m in self.moe)
        return dataclasses.replace(self, unit=swap(self.unit), params=params, moe=moe)


@dataclass
class ModelProfile:
    """Chunk costs per tp degree, and what the search needs to know about the model."""

    model_name: str
    num_parameters: int
    global_batch: int
    precision: str
    chunks: dict[int, list[ChunkCost]] = field(default_factory=dict)  # tp degree -> chunks in order
    tp_errors: dict[int, str] = field(default_factory=dict)  # tp degrees that cannot shard, and why
    sample_batch: int = 1  # samples per microbatch the graph was captured with
    batch_statistics: bool = False  # BatchNorm in training: only dp=1 with one microbatch is exact
    template: str | None = None  # the list of identical blocks captured once, if any
    regions: dict = field(default_factory=dict)  # tp degree -> TpRegionPlans the lowering found
    vocab: dict = field(default_factory=dict)  # tp degree -> vocabulary-parallel module paths
    expert_shards: dict = field(default_factory=dict)  # tp degree -> {expert tensor: ShardLayout} (tp_expert.py)
    seq_len: int = 0  # the example's sequence length (dim 1 of its first input; 0: none): cp cuts it in 2 x cp

    @property
    def num_chunks(self) -> int:
        return len(next(iter(self.chunks.values())))

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted(self.chunks))

    @property
    def moe_layers(self) -> tuple[MoeCost, ...]:
        """Every recognised MoE layer, in chunk order (the same at every tp degree)."""
        return tuple(m for ch in next(iter(self.chunks.values())) for m in ch.moe)


def _signature(stage) -> tuple:
    """What two chunks must share to have the same activation figures: ops, shapes, weights."""
    ops = tuple((n.op, str(n.target) if n.op != "call_module" else type(stage.gm.get_submodule(n.target)).__name__,
                 getattr(get_meta(n, TENSOR), "shape", None)) for n in stage.gm.graph.nodes if n.op != "get_attr")
    return ops, tuple(tuple(p.shape) for p in stage.gm.parameters())


def _chunk(stage, segments, start: int, end: int, b0: int, seen: dict) -> ChunkCost:
    calls = [n for s in segments[start:end] for n in s.nodes]
    flops = sum(c.flops for n in calls if (c := get_meta(n, COST)) is not None)
    written = sum(c.activation_bytes for n in calls if (c := get_meta(n, COST)) is not None)
    params, buffers = rank_params([stage])
    is_block = segments[start].is_block
    key = _signature(stage)
    if key not in seen:  # identical blocks are measured once
        saved, transient = {}, {}
        for mode in (RECOMPUTE if is_block else ("none",)):  # recompute regions are whole blocks
            probe = stage if mode == "none" else recompute_stage(_copy_stage(stage), mode=mode)
            acts = stage_activations(probe.gm)
            saved[mode], transient[mode] = acts.saved / b0, acts.transient / b0
        for mode in RECOMPUTE:
            saved.setdefault(mode, saved["none"])
            transient.setdefault(mode, transient["none"])
        seen[key] = (saved, transient, _attention_bytes(stage.gm))
    saved, transient, (kv, qo, heads) = seen[key]
    comms = tuple(CommCost(r.direction, r.op, r.nbytes / b0, r.recompute) for r in audit_collectives(stage.gm))
    recv = sum(_edge_bytes(e) for e in stage.recvs) / b0
    unit = user_name(segments[start].unit)
    gemms = sum(1 for n in calls if (c := get_meta(n, COST)) is not None and c.flops > 0)
    return ChunkCost(unit=unit, is_block=is_block, flops=flops / b0, ops=len(calls),
                     bytes_written=written / b0, params=tuple(params), buffer_bytes=buffers, saved=saved,
                     transient=transient, comms=comms, recv_bytes=recv, gemms=gemms,
                     attention_kv=kv / b0, attention_qo=qo / b0, attention_heads=heads)


def _attention_bytes(gm) -> tuple[int, int, int]:
    """(bytes of K and V, bytes of Q and the output, the fewest query heads) of the attentions
    :func:`~autopar.passes.context_parallel.attention.find_attention` recognises in ``gm``, SDPA and eager alike:
    what context parallelism's ring (K/V) and all-to-all (Q, K, V, output) move."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def nbytes(name: str) -> int:
        info = get_meta(nodes[name], TENSOR) if name in nodes else None
        return getattr(info, "nbytes", 0) or 0

    found = find_attention(gm).found
    kv = sum(nbytes(a.k) + nbytes(a.v) for a in found)
    qo = sum(nbytes(a.q) * (1 + a.v_head_dim / a.head_dim) for a in found)  # the output: q's shape, v's head dim
    return kv, qo, min((a.num_heads for a in found), default=0)


def _edge_bytes(edge) -> int:
    numel = 1
    for d in edge.shape:
        numel *= d
    return numel * torch.empty((), dtype=edge.dtype).element_size()


def _copy_stage(stage):
    return dataclasses.replace(stage, gm=copy.deepcopy(stage.gm))


def _chunks_of(gm, b0: int) -> list[ChunkCost]:
    """Cut a sharded graph at every place a stage may begin and cost each piece."""
    layers = _moe_costs(gm, b0)
    segments = pipeline_segments(gm)
    allowed = _allowed_starts(segments)
    bounds = [0] + allowed + [len(segments)]
    gm, _ = cut_stages(gm, num_stages=len(bounds) - 1, stage_starts=[segments[a].unit for a in allowed])
    stages = split_graph(gm, num_stages=len(bounds) - 1)
    seen: dict = {}
    chunks = [_chunk(stages[i], segments, bounds[i], bounds[i + 1], b0, seen) for i in range(len(stages))]
    return [dataclasses.replace(ch, moe=tuple(m for m in layers if set(m.expert_params) & {p.name for p in ch.params}))
            for ch in chunks]


def _moe_costs(gm, b0: int) -> list[MoeCost]:
    """The MoE layers of the (unsplit) graph with the bytes their all-to-alls would move per sample."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = []
    for layer in find_moe_layers(gm).layers:
        ops = [by_name[n] for n in layer.expert_ops]
        rows = get_meta(ops[0].args[0], TENSOR) if ops else None
        back = get_meta(ops[-1], TENSOR) if ops else None
        out.append(MoeCost(path=user_name(layer.path), form=layer.form, num_experts=layer.num_experts,
                           top_k=layer.top_k, dispatch_bytes=(rows.nbytes if rows else 0) / b0,
                           combine_bytes=(back.nbytes if back else 0) / b0,
                           expert_params=tuple(user_name(w) for w in layer.expert_weights)))
    return out


def _expand(chunks: list[ChunkCost], cap: Captured) -> list[ChunkCost]:
    """With a block template: the template block's chunk repeated for every block not captured."""
    t = cap.template
    if t is None:
        return chunks
    last = f"{t.path}.{t.captured - 1}"
    i = next(k for k, c in enumerate(chunks) if c.unit == last)
    extra = [chunks[i].renamed(last, f"{t.path}.{j}") for j in range(t.captured, t.num_blocks)]
    return chunks[: i + 1] + extra + chunks[i + 1:]


def _at_bound(model, example_inputs, example_target, options: CompileOptions):
    """The example with its sequences padded to the bound (``max_seq_len``, else the model's maximum) when
    batches may be longer than the example's (docs/batches.md): the planner costs the longest batch."""
    if options.dynamic_shapes == "static":
        return example_inputs, example_target
    known = (options.max_seq_len, "") if options.max_seq_len else model_max_length(model)
    if known is None:
        return example_inputs, example_target
    inputs = example_inputs if isinstance(example_inputs, Mapping) else (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    return padded_to(inputs, example_target, known[0])


def _capture(model, *, example_inputs, loss_fn, example_target, options: CompileOptions):
    """Capture at one sample per microbatch (all samples when batch statistics forbid splitting), with the
    sequences as long as the bound."""
    example_inputs, example_target = _at_bound(model, example_inputs, example_target, options)
    batch = next(iter(example_inputs.values() if isinstance(example_inputs, Mapping) else example_inputs)).shape[0]
    opts = options.model_copy(update={"num_microbatches": 1, "schedule": "1f1b", "num_virtual": None,
                                      "recompute": "none", "zero_stage": 0,
                                      "expert_parallel": 1})  # experts whole
    try:
        return capture_and_annotate(model, mesh=MeshShape(dp=batch), example_inputs=example_inputs,
                                    example_target=example_target, loss_fn=loss_fn, options=opts), 1, False
    except PlanError as exc:
        if "batch statistic" not in str(exc).lower() and "batchnorm" not in str(exc).lower():
            raise
        cap = capture_and_annotate(model, mesh=MeshShape(), example_inputs=example_inputs,
                                   example_target=example_target, loss_fn=loss_fn, options=opts)
        return cap, batch, True


def _shard(cap: Captured, tp: int):
    """The graph as tp rank 0 of ``tp`` runs it (a vocabulary tp does not divide stays whole, as lowering does)."""
    p = cap.plan
    plan = resolve_plan(cap.options, given=None, mesh=MeshShape(dp=p.mesh.dp, tp=tp), batch=p.global_batch_size,
                        model_name=p.model_name, num_parameters=p.num_parameters)
    with torch.random.fork_rng(devices=[]):
        state, vocab = shard_captured(dataclasses.replace(cap, plan=plan), tp_rank=0)
    return state.gm, state.region_plans, vocab, state.specs


def _seq_len(example_inputs) -> int:
    """Dim 1 of the first input with two or more dims (a token batch's sequence), 0 without one."""
    values = example_inputs.values() if isinstance(example_inputs, Mapping) else example_inputs
    first = next((t for t in values if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return int(first.shape[1]) if first is not None else 0


def profile_model(model, *, example_inputs: tuple, loss_fn, example_target, tp_degrees=(1,),
                  options: CompileOptions | None = None) -> ModelProfile:
    """Chunk costs of ``model`` for each tp degree (those that cannot shard go to ``tp_errors``)."""
    options = options or CompileOptions()
    if not isinstance(example_inputs, Mapping):  # a dict batch stays one (keyword inputs)
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    cap, b0, stats = _capture(model, example_inputs=example_inputs, loss_fn=loss_fn,
                              example_target=example_target, options=options)
    profile = ModelProfile(model_name=cap.plan.model_name, num_parameters=cap.plan.num_parameters,
                           global_batch=cap.plan.global_batch_size, precision=cap.plan.precision, sample_batch=b0,
                           batch_statistics=stats, template=cap.template.path if cap.template else None,
                           seq_len=_seq_len(example_inputs))
    for tp in sorted(set(tp_degrees)):
        try:
            gm, regions, vocab, specs = _shard(cap, tp)
        except AutoparError as exc:
            profile.tp_errors[tp] = exc.what
            continue
        profile.chunks[tp] = _expand(_chunks_of(gm, b0), cap)
        profile.regions[tp] = cap.template.extend_regions(regions) if cap.template else regions
        profile.vocab[tp] = tuple(user_name(p) for p in vocab.paths())
        experts = {name for ch in profile.chunks[tp] for m in ch.moe for name in m.expert_params}
        profile.expert_shards[tp] = {user_name(k): v
                                     for k, v in specs.items() if user_name(k) in experts}
        log.info("profiled tp=%d: %d chunks", tp, len(profile.chunks[tp]))
    if not profile.chunks:
        raise PlanError(f"the model cannot be sharded for any tp degree in {sorted(set(tp_degrees))}: "
                        f"{profile.tp_errors}", where="autopar planner", fix="allow tp=1")
    return profile
