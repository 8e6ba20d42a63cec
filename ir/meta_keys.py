"""The one registry of node.meta keys that autopar's passes write and read.

Every key is named ``autopar.<what>`` and holds a frozen dataclass. The table :data:`META_KEYS`
says which pass writes each key and which passes read it; a transform that invalidates a key
drops it (see :func:`drop_meta`).

Example::

    >>> from autopar.models.examples import gpt_tiny
    >>> from autopar.passes.frontend.capture import capture
    >>> model, (x,), loss_fn, y = gpt_tiny()
    >>> gm = capture(model, (x,), loss_fn=loss_fn, example_target=y).gm
    >>> from autopar.passes.frontend.annotate import annotate
    >>> gm = annotate(gm, example_inputs=(x, y), model=model)
    >>> from autopar.ir.meta_keys import TENSOR, get_meta
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_function")   # the positions' arange
    >>> get_meta(node, TENSOR).shape, get_meta(node, TENSOR).dtype
    ((32,), torch.int64)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
import torch.fx as fx

from autopar.ir.shard_layout import ShardLayout

__all__ = [
    "TENSOR",
    "COST",
    "PARAM",
    "MODULE",
    "STAGE",
    "TP_PLACEMENT",
    "INDEX_BOUND",
    "MOE",
    "MOE_LAYER",
    "MoeRole",
    "MoeLayer",
    "MOE_EXCHANGE",
    "MoeExchange",
    "ATTENTION",
    "AttnLayout",
    "MaskInfo",
    "AttentionInfo",
    "SEQ",
    "SeqInfo",
    "TensorInfo",
    "NodeCost",
    "ParamInfo",
    "ModuleInfo",
    "StageInfo",
    "Placement",
    "IndexBound",
    "range_text",
    "MetaKey",
    "META_KEYS",
    "get_meta",
    "set_meta",
    "drop_meta",
]

TENSOR = "autopar.tensor"
COST = "autopar.cost"
PARAM = "autopar.param"
MODULE = "autopar.module"
STAGE = "autopar.stage"
TP_PLACEMENT = "autopar.tp_placement"
INDEX_BOUND = "autopar.index_bound"
MOE = "autopar.moe"
MOE_LAYER = "autopar.moe_layer"
MOE_EXCHANGE = "autopar.moe_exchange"
ATTENTION = "autopar.attention"
SEQ = "autopar.seq"


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a node's (first) tensor output; ``None`` fields for non-tensors."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int


@dataclass(frozen=True)
class NodeCost:
    """Forward FLOPs of the node and bytes of the activation it produces."""

    flops: int
    activation_bytes: int


@dataclass(frozen=True)
class ParamInfo:
    """For a get_attr node: the parameter's canonical name, every alias (tied weights) and users."""

    name: str
    aliases: tuple[str, ...]
    is_parameter: bool
    numel: int
    used_by_modules: tuple[str, ...]


@dataclass(frozen=True)
class ModuleInfo:
    """The module path a node came from and the pipeline unit (block) it belongs to."""

    path: str
    unit: str


@dataclass(frozen=True)
class StageInfo:
    """The pipeline stage a node was assigned to."""

    stage: int


@dataclass(frozen=True)
class Placement:
    """Tensor-parallel placement of a node's output: 'R' replicated, 'S' sharded as ``layout`` says, 'P' partial sum.

    A sharded output's :class:`~autopar.ir.shard_layout.ShardLayout` says how it is cut over tp: its dim,
    equal ``chunks`` (a fused qkv projection's output), ``parts`` (fewer kv heads than tp), ``inner`` (GQA's
    broadcast of a kv head to its query heads) or unequal ``blocks`` (a fused ``[q | k | v]`` whose q and kv
    blocks differ in size). ``dim``, ``chunks``, ``parts``, ``inner`` and ``blocks`` read the layout's (None,
    1, 0, None, () when not sharded).
    """

    kind: str
    layout: ShardLayout | None = None

    @classmethod
    def shard(cls, dim: int, chunks: int = 1, parts: int = 0, inner: int | None = None,
              blocks: tuple[tuple[int, int], ...] = ()) -> "Placement":
        """'S': sharded on ``dim`` as a :class:`ShardLayout` of these fields."""
        return cls("S", ShardLayout(dim, chunks, parts, inner, blocks))

    def __post_init__(self) -> None:
        assert self.kind in ("R", "S", "P") and (self.layout is not None) == (self.kind == "S"), self

    def replace(self, **changes) -> "Placement":
        """This sharded placement with its layout's fields ``changes`` replaced."""
        return Placement("S", replace(self.layout, **changes))

    @property
    def dim(self) -> int | None:
        return self.layout.dim if self.layout else None

    @property
    def chunks(self) -> int:
        return self.layout.chunks if self.layout else 1

    @property
    def parts(self) -> int:
        return self.layout.parts if self.layout else 0

    @property
    def inner(self) -> int | None:
        return self.layout.inner if self.layout else None

    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        return self.layout.blocks if self.layout else ()

    def __str__(self) -> str:
        return f"S({self.layout})" if self.kind == "S" else self.kind


@dataclass(frozen=True)
class IndexBound:
    """For a graph input (placeholder) that indexes tables: valid values are ``low..rows-1``; the lookups.

    ``low`` is 0, or ``-rows`` where only tensor indexing (which wraps negative indices) reads the input.
    """

    rows: int
    lookups: tuple[str, ...]
    low: int = 0


def range_text(low: int, rows: int) -> str:
    """The valid indices of a table as text: 'rows 0..31', or 'rows -32..31' where negatives wrap."""
    return f"rows {low}..{rows - 1}"


@dataclass(frozen=True)
class MoeRole:
    """The part a node plays in a mixture-of-experts layer (module path ``layer``).

    ``role``: router, scores, topk, row_ids, offsets, expert_weight, expert_op, combine, shared_expert,
    aux_loss (passes/moe/moe_detect.py).
    """

    layer: str
    role: str


@dataclass(frozen=True)
class MoeLayer:
    """One recognised MoE layer (on its router's linear node): its form and the names of its nodes.

    ``form``: ``grouped`` (sorted rows, grouped matmul with offsets), ``gathered`` (a 3-D expert tensor
    indexed by each row's expert id) or ``loop`` (a ModuleList of experts run on every token).
    """

    path: str
    form: str
    num_experts: int
    top_k: int
    scoring: str
    router: str
    router_weight: str
    topk: str
    expert_weights: tuple[str, ...]
    expert_ops: tuple[str, ...]
    row_ids: str | None
    offsets: str | None
    combine: str
    shared_experts: tuple[str, ...]
    aux_loss: tuple[str, ...]


@dataclass(frozen=True)
class MoeExchange:
    """An all-to-all node of expert parallelism (``MoeDispatch`` or ``MoeCombine``) and the split it serves.

    ``role``: ``dispatch`` or ``combine``; ``layer``: the MoE layer's module path; ``index``: the layer's
    number (``moe_dispatch_<index>``); ``ep_rank``: the ep rank whose graph holds the node;
    ``experts``: for every ep rank, the ``[first, end)`` expert indices it holds (of ``num_experts``);
    ``expert_weights``: the split 3-D tensors (graph names); ``capacity_factor``: None when dropless.
    """

    role: str
    layer: str
    index: int
    num_experts: int
    ep: int
    ep_rank: int
    experts: tuple[tuple[int, int], ...]
    expert_weights: tuple[str, ...]
    capacity_factor: float | None = None


@dataclass(frozen=True)
class AttnLayout:
    """Which dim of an attention operand holds what. ``heads == batch``: one dim of batch x heads (``bmm``)."""

    batch: int
    heads: int
    seq: int
    feature: int


@dataclass(frozen=True)
class MaskInfo:
    """One mask or bias term an attention's scores meet, read off its evaluation (passes/context_parallel).

    ``how``: ``add`` (additive), ``keep`` (True may meet) or ``drop`` (True is masked); ``sources``: the
    inputs, parameters and position producers it is built from; ``pattern``: ``full``, ``causal``,
    ``window`` (``q - k < window``), ``dense``; ``padding``/``documents``: the input whose zeros mask keys /
    whose restarting positions split documents; ``bias``: ``none``, ``alibi`` (``alibi_slopes`` per head),
    ``learned`` (reads a parameter) or ``other``.
    """

    node: str
    how: str
    sources: tuple[str, ...]
    pattern: str
    window: int | None = None
    padding: str | None = None
    documents: str | None = None
    bias: str = "none"
    alibi_slopes: tuple[float, ...] = ()


@dataclass(frozen=True)
class AttentionInfo:
    """One attention found in a captured graph (on its output node): its operands, layout and rules.

    ``form``: ``sdpa`` (an SDPA op) or ``eager`` (matmul, scale, mask, softmax, matmul); ``q``/``k``/``v``
    name the operands as the attention reads them (k before its transpose), ``kv_source`` the k before a
    grouped-query repeat; ``latent``: the compressed kv a low-rank down projection makes (MLA);
    ``nodes``: the attention's own nodes (scores product to output), which a cp strategy replaces.
    """

    path: str
    form: str
    output: str
    q: str
    k: str
    v: str
    q_layout: AttnLayout
    k_layout: AttnLayout
    v_layout: AttnLayout
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    dropout: float
    masks: tuple[MaskInfo, ...]
    nodes: tuple[str, ...]
    kv_source: str | None = None
    latent: str | None = None


@dataclass(frozen=True)
class SeqInfo:
    """How a node's value meets the sequence under context parallelism (passes/context_parallel/seq_dims.py).

    ``rule``: the rule that placed it (``input``, ``pointwise``, ``positions``, ``positional``, ``attention``,
    ``attention_mask``, ``rowwise``, ``label_shift``, ``reduce``, ``scan``, ``loss``, ``replicated``, ``refused``);
    ``dim``: the dim that holds the sequence (None: none does); ``note``: what the rule asks of cp.
    """

    rule: str
    dim: int | None = None
    note: str = ""


@dataclass(frozen=True)
class MetaKey:
    """One row of the registry: the key, the dataclass it holds, its writer and its readers."""

    key: str
    holds: type
    writer: str
    readers: tuple[str, ...]


META_KEYS = MappingProxyType(
    {
        TENSOR: MetaKey(TENSOR, TensorInfo, "passes.frontend.annotate.annotate_tensors",
                        ("passes.pipeline.pipeline_split", "passes.tp.tensor_parallel", "ops.p2p",
                         "passes.data_parallel.zero3")),
        COST: MetaKey(COST, NodeCost, "passes.frontend.annotate.annotate_tensors",
                      ("passes.pipeline.partition", "autopar.planner")),
        PARAM: MetaKey(PARAM, ParamInfo, "passes.frontend.annotate.annotate_params",
                       ("passes.tp.tensor_parallel", "passes.pipeline.pipeline_split", "autopar.planning")),
        MODULE: MetaKey(MODULE, ModuleInfo, "passes.frontend.annotate.annotate_modules",
                        ("passes.pipeline.partition", "passes.tp.tensor_parallel", "passes.tp.tp_regions",
                         "passes.data_parallel.zero3")),
        STAGE: MetaKey(STAGE, StageInfo, "passes.pipeline.partition.assign_stages",
                       ("passes.pipeline.pipeline_split",)),
        TP_PLACEMENT: MetaKey(TP_PLACEMENT, Placement, "passes.tp.tensor_parallel.shard_tensor_parallel",
                              ("passes.tp.sequence_parallel", "passes.tp.tp_random")),  # vocab/SP passes write it too
        INDEX_BOUND: MetaKey(INDEX_BOUND, IndexBound, "passes.frontend.index_bounds.annotate_index_bounds",
                             ("runtime.execution.index_guard", "autopar.validation")),
        MOE: MetaKey(MOE, MoeRole, "passes.moe.moe_detect.annotate_moe", ("passes.moe.moe_expert_parallel",)),
        MOE_LAYER: MetaKey(MOE_LAYER, MoeLayer, "passes.moe.moe_detect.annotate_moe",
                           ("passes.moe.moe_expert_parallel", "autopar.memory")),
        MOE_EXCHANGE: MetaKey(MOE_EXCHANGE, MoeExchange, "passes.moe.moe_expert_parallel.shard_experts",
                              ("autopar.report",)),
        ATTENTION: MetaKey(ATTENTION, AttentionInfo, "passes.context_parallel.attention.annotate_attention",
                           ("passes.context_parallel.seq_dims", "passes.context_parallel.cp_shard")),
        SEQ: MetaKey(SEQ, SeqInfo, "passes.context_parallel.seq_dims.annotate_sequence",
                     ("passes.context_parallel.cp_shard",)),
    }
)


def get_meta(node: fx.Node, key: str):
    """Read a registered key from ``node.meta`` (``None`` when absent)."""
    assert key in META_KEYS, f"unregistered meta key {key}"
    return node.meta.get(key)


def set_meta(node: fx.Node, key: str, value) -> None:
    """Write a registered key, checking the value's type against the registry."""
    spec = META_KEYS[key]
    assert isinstance(value, spec.holds), f"{key} holds {spec.holds.__name__}, got {type(value)}"
    node.meta[key] = value


def drop_meta(gm: fx.GraphModule, *keys: str) -> None:
    """Remove keys a transform has invalidated from every node."""
    for node in gm.graph.nodes:
        for key in keys:
            node.meta.pop(key, None)
