"""Model-state memory of one rank: parameters, fp32 masters, gradients and optimizer state.

The figures follow what the runtime allocates (``docs/memory.md`` has the formulas):

- element counts come from the rank's stage graphs (after tensor-parallel sharding, each
  parameter once even when a tied weight appears on two of its stages), never from allocations,
  so a meta-device model costs nothing;
- ZeRO shards over the ranks a weight's gradient is summed over, dp x cp (``dcp``; dp without context
  parallelism), called dp below;
- ZeRO-1/2 partition whole parameters over dp exactly as the runtime does
  (:func:`autopar.runtime.state.zero.partition_params`); ZeRO-3 keeps ``ceil(n / dp)`` elements of each
  trainable parameter (flattened, zero-padded to a multiple of dp), and of an expert tensor split over
  ep (``local``) ``ceil(n / edp)`` of its ep-local ``n`` (ZeRO-3 shards it over the edp = dp / ep
  ranks holding the same experts; whole where dp == ep), and ZeRO-1/2 partition the expert tensors
  whole over those ranks as the runtime does (:func:`autopar.runtime.state.zero.owned_experts`), so their
  optimizer state (and ZeRO-2's gradients) is on one edp rank;
- ``precision="bf16"`` keeps a bf16 compute copy of every parameter and fp32 gradients, and an fp32
  master where the parameter is stepped: the master is optimizer state (ZeRO's K = 12 bytes per
  parameter for mixed-precision Adam), so ZeRO-1/2 keep it on the owner only and ZeRO-3 keeps the
  rank's 1/N block (frozen parameters keep theirs everywhere); ``"fp32"`` keeps the parameter and
  an fp32 gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import PlanError
from autopar.parallel_dims import ParallelDims

__all__ = ["OPTIMIZER_STATE", "ParamEntry", "StateFigures", "rank_params", "owned_names", "owned_experts",
           "state_figures"]

#: fp32 state tensors per parameter element, and bytes of per-tensor scalars (Adam's ``step``).
OPTIMIZER_STATE = {"sgd": (0, 0), "momentum": (1, 0), "adam": (2, 4), "adamw": (2, 4)}
FP32 = 4


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as a rank holds it: user name, elements, bytes per element, trainable."""

    name: str
    numel: int
    itemsize: int
    trainable: bool


@dataclass(frozen=True)
class StateFigures:
    """Bytes of one rank's model states and buffers."""

    params: int
    master_params: int
    grads: int
    optimizer: int
    buffers: int


def rank_params(stages) -> tuple[list[ParamEntry], int]:
    """(parameters, buffer bytes) of a rank running ``stages``, each tensor once."""
    from autopar.ir.graph_names import user_name

    seen, params, buffer_bytes = set(), [], 0
    for stage in stages:
        for target in stage.param_names:
            p = stage.gm.get_parameter(target)
            if id(p) not in seen:
                seen.add(id(p))
                params.append(ParamEntry(user_name(target), p.numel(), p.element_size(), p.requires_grad))
        for b in stage.gm.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                buffer_bytes += b.numel() * b.element_size()
    return params, buffer_bytes


class _Numel:
    """What :func:`partition_params` needs of a tensor."""

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


def owned_names(params: list[ParamEntry], *, dp: int, local: frozenset[str] = frozenset()) -> list[list[str]]:
    """The names each dp rank owns under ZeRO-1/2, partitioned as the runtime partitions them
    (``local`` parameters, MoE experts split over ep, are outside it: see :func:`owned_experts`)."""
    from autopar.runtime.state.zero import partition_params

    return partition_params([(p.name, _Numel(p.numel)) for p in params if p.trainable and p.name not in local], dp)


def owned_experts(params: list[ParamEntry], *, dims: ParallelDims, coords: dict[str, int],
                  local: frozenset[str]) -> set[str]:
    """The expert tensors (``local``) the rank at ``coords`` owns under ZeRO-1/2: the runtime's rule
    (:func:`autopar.runtime.state.zero.owned_experts`, over the rank's edp group)."""
    from autopar.runtime.state.zero import owned_experts as rule

    return rule([(p.name, _Numel(p.numel)) for p in params if p.trainable and p.name in local], dims=dims, coords=coords)


def state_figures(params: list[ParamEntry], buffer_bytes: int, *, zero_stage: int, dims: ParallelDims,
                  coords: dict[str, int], precision: str, optimizer: str, owned: list[list[str]] | None = None,
                  local: frozenset[str] = frozenset()) -> StateFigures:
    """Model-state bytes of the rank at mesh coordinates ``coords`` of ``dims`` holding ``params`` (``local``:
    MoE experts split over ep, see :func:`owned_names`)."""
    if optimizer not in OPTIMIZER_STATE:
        raise PlanError(f"unknown optimizer kind {optimizer!r}", where="estimate_memory(optimizer=...)",
                        fix=f"use one of {', '.join(OPTIMIZER_STATE)}")
    per_element, per_tensor = OPTIMIZER_STATE[optimizer]
    dp = dims.dcp  # ZeRO shards over dp x cp: the ranks one weight's gradient is summed over (dp itself without cp)
    sharded3 = zero_stage == 3 and dp > 1

    def held(p: ParamEntry) -> int:  # elements of p this rank keeps
        ways = dims.edcp if p.name in local else dp  # expert tensors: ZeRO-3 over edp (x cp)
        return -(-p.numel // ways) if sharded3 and p.trainable else p.numel

    trainable = [p for p in params if p.trainable]
    if zero_stage in (1, 2) and dp > 1:
        mine = set((owned or owned_names(params, dp=dp, local=local))[dims.index("dcp", coords)]) | \
            owned_experts(params, dims=dims, coords=coords, local=local)
        stepped = [p for p in trainable if p.name in mine]
    else:
        stepped = trainable
    with_grad = stepped if zero_stage == 2 and dp > 1 else trainable
    with_master = stepped + [p for p in params if not p.trainable] if precision == "bf16" else []
    return StateFigures(
        params=sum(held(p) * p.itemsize for p in params),
        master_params=sum(held(p) * FP32 for p in with_master),
        grads=sum(held(p) * FP32 for p in with_grad),
        optimizer=sum(held(p) * FP32 * per_element + per_tensor for p in stepped),
        buffers=buffer_bytes,
    )
