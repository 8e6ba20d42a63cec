"""Gradient clipping by the global norm over every shard and mesh axis (``max_grad_norm``).

The norm is the one ``torch.nn.utils.clip_grad_norm_`` computes on a single device: the 2-norm of
every gradient of the model, each parameter counted once. Each rank adds the squares of the
gradients it *counts* (:func:`counted_here`), and one all-reduce over the whole world sums them:

- tensor parallelism: a parameter sharded over tp is counted on every tp rank (its shards); a
  replicated one only on tp rank 0 (not tp times);
- pipeline parallelism: parameters of different stages are summed; a weight tied across stages
  (``Plan.shared_params``, gradients already summed) is counted only on its first stage's rank;
- data parallelism: after the dp reduction every replica holds the same gradient, so it is
  counted on dp rank 0 only; under ZeRO-1/2 (owners) each dp rank counts what it owns
  (``ShardedOptimizer.owned_parameters``), and a ZeRO-3 flat shard is counted on the rank holding it:
  both partition the model;
- expert parallelism: an expert tensor split over ep holds other experts on each rank of an ep
  group and the same ones on the dp/ep ranks of its edp group (:mod:`autopar.runtime.state.moe_groups`),
  so it is counted on the ranks of the first ep group (edp index 0), each expert once; under
  ZeRO-1/2 with edp > 1 (each expert owned by one edp rank) on its owner; a ZeRO-3 shard of it (over
  edp) on the rank holding it, as every ZeRO-3 shard.

Then every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``, torch's coefficient.

A :class:`~autopar.runtime.execution.program.RankProgram` computes the norm every step, clipping or not: each
rank's sum of squares (over :func:`counted_parameters`) rides on the all-reduce of the step's non-finite
check, so neither the report (``program.last_step.grad_norm``) nor clipping costs a collective of its
own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ir.graph_names import user_name
from autopar.ops.collectives import issue
from autopar.ops.zero3_ops import zero3_targets
from autopar.runtime.execution.rank_context import ProgramState

__all__ = ["counted_here", "local_squares", "squares_of", "global_grad_norm", "scale_gradients", "clip_grad_norm",
           "counted_parameters", "clip_program_gradients"]


def counted_here(name: str, *, plan, coords: dict[str, int], stage_to_pp: list[int],
                 owned: set[str] | None, sharded: frozenset[str] = frozenset(),
                 owned_experts: set[str] | None = None) -> bool:
    """Does this rank count ``name``'s gradient in the global norm? (``owned``: the ZeRO-1/2 parameters this
    dp rank owns, None when nothing is owned whole; ``sharded``: those held as ZeRO-3 flat shards;
    ``owned_experts``: the expert tensors this rank owns in its edp group, None when not partitioned.)"""
    if name not in plan.param_shards and coords["tp"] != 0:
        return False
    stages = plan.shared_params.get(name)
    if stages and stage_to_pp[min(stages)] != coords["pp"]:
        return False
    if name in sharded:
        return True
    if plan.expert_parallel > 1 and name in plan.expert_params:  # each ep rank of the first ep group: its experts
        return name in owned_experts if owned_experts is not None else plan.dims.index("edcp", coords) == 0
    if owned is not None:
        return name in owned
    return plan.dims.index("dcp", coords) == 0  # (replicated over dp x cp: its first rank counts)


def local_squares(named: list[tuple[str, torch.nn.Parameter]], *, plan, coords: dict[str, int],
                  stage_to_pp: list[int], owned: set[str] | None, sharded: frozenset[str] = frozenset(),
                  owned_experts: set[str] | None = None) -> torch.Tensor:
    """The sum of the squares of the gradients this rank counts (float64, 0-dim): summed over the world,
    the square of the global norm."""
    return squares_of([p for name, p in named if counted_here(
        name, plan=plan, coords=coords, stage_to_pp=stage_to_pp, owned=owned, sharded=sharded,
        owned_experts=owned_experts)], device=named[0][1].device if named else None)


def squares_of(params: list[torch.nn.Parameter], *, device=None) -> torch.Tensor:
    """The sum of the squares of ``params``' gradients (float64, 0-dim; those without one skipped)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            squares += torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32).double() ** 2
    return squares


def global_grad_norm(named: list[tuple[str, torch.nn.Parameter]], *, plan, coords: dict[str, int],
                     stage_to_pp: list[int], owned: set[str] | None, sharded: frozenset[str] = frozenset(),
                     group=None, guard=None, owned_experts: set[str] | None = None) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, the same value on every rank (collective over ``group``)."""
    squares = local_squares(named, plan=plan, coords=coords, stage_to_pp=stage_to_pp, owned=owned, sharded=sharded,
                            owned_experts=owned_experts)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        issue("all_reduce", dist.all_reduce, squares, group=group, guard=guard, purpose="the global gradient norm")
    return squares.sqrt().to(torch.float32)


@torch.no_grad()
def scale_gradients(named: list[tuple[str, torch.nn.Parameter]], *, max_norm: float, norm: torch.Tensor) -> None:
    """Scale every local gradient by torch's ``min(1, max_norm / (norm + 1e-6))``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for _, p in named:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))


@torch.no_grad()
def clip_grad_norm(named: list[tuple[str, torch.nn.Parameter]], *, max_norm: float, plan,
                   coords: dict[str, int], stage_to_pp: list[int], owned: set[str] | None,
                   sharded: frozenset[str] = frozenset(), group=None, guard=None,
                   owned_experts: set[str] | None = None) -> torch.Tensor:
    """Scale every local gradient so the global norm is at most ``max_norm``; returns the norm before."""
    total = global_grad_norm(named, plan=plan, coords=coords, stage_to_pp=stage_to_pp, owned=owned,
                             sharded=sharded, group=group, guard=guard, owned_experts=owned_experts)
    scale_gradients(named, max_norm=max_norm, norm=total)
    return total


def _counting(program: ProgramState) -> dict:
    """What :func:`counted_here` needs of a program: owners (ZeRO-1/2), flat shards (ZeRO-3), expert owners."""
    plan = program.plan
    owners = program.optimizer.owner_of() if hasattr(program.optimizer, "owner_of") else None
    # flat ZeRO-3 shards (over dp; expert tensors over edp): each rank counts its own
    sharded = frozenset(user_name(t) for s in program.stages.values() for t in zero3_targets(s.gm))
    owned = None  # replicated over dp: dp rank 0 counts
    if owners is not None:
        owned = {n for n, k in owners.items() if k == plan.dims.index("dcp", program.info.coords)}
    expert_owners = program.optimizer.expert_owner_of() if hasattr(program.optimizer, "expert_owner_of") else None
    owned_experts = None  # ZeRO-1/2 with experts owned over edp: each counted by its owner
    if expert_owners is not None:
        owned_experts = {n for n, k in expert_owners.items() if k == plan.dims.index("edcp", program.info.coords)}
    return dict(plan=plan, coords=program.info.coords, stage_to_pp=list(program.schedule.stage_to_rank), owned=owned,
                sharded=sharded, owned_experts=owned_experts)


def counted_parameters(program: ProgramState) -> list[torch.nn.Parameter]:
    """The parameters whose gradients this rank counts in the global norm (fixed for a program: read it once).
    The sum of their squares (:func:`squares_of`, no collective) rides on the step's non-finite check's
    all-reduce (runtime/execution/program.py)."""
    counting = _counting(program)
    return [p for name, p in program.named_params if counted_here(name, **counting)]


def clip_program_gradients(program: ProgramState, *, max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Clip a RankProgram's gradients (after gradient sync, before the step); returns the global norm.
    ``norm``: the global norm already summed (no all-reduce here then)."""
    if norm is None:
        norm = global_grad_norm(program.named_params, guard=program.comm_guard, **_counting(program))
    scale_gradients(program.named_params, max_norm=max_norm, norm=norm)
    return norm
