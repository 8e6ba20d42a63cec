"""Mixed precision (``precision="bf16"``): bf16 compute, fp32 master weights, fp32 gradients.

The design is Megatron's (bf16 model, fp32 "main" parameters and gradients):

- **Capture in bf16.** :func:`autopar.passes.frontend.low_precision.low_precision_copy` gives the compiler a
  copy of the model whose floating parameters and buffers are bf16, so the captured graph is the model as bf16 code:
  a deliberate ``x.float()`` stays fp32 and ``.type_as(x)`` becomes bf16. The stage graphs then
  hold bf16 *compute* parameters and send bf16 activations between stages.
- **fp32 masters.** :func:`fp32_masters` cuts this rank's fp32 masters from the user's original
  (fp32) weights, sharded exactly as the graph's parameters (tensor-parallel shard specs).
  :class:`MasterWeights` owns them: they are what the rest of the runtime sees as "the
  parameters" (gradient sync, ZeRO, clipping, the optimizer, ``full_state_dict``).
- **fp32 gradient accumulation.** Each compute parameter has a post-accumulate-grad hook that
  adds its bf16 gradient into the master's fp32 ``.grad`` and drops the bf16 one, so gradients
  of every microbatch are summed in fp32 (:meth:`MasterWeights.collect` catches gradients set
  without autograd's accumulation, as split backward's W does). The master's own
  post-accumulate-grad hooks then run, so DDP's overlapped buckets see masters as parameters.
- **After the step** :meth:`MasterWeights.publish` rounds the updated masters into the compute
  parameters.
- **Masters are optimizer state** (ZeRO's K = 12 bytes per parameter for Adam): a rank keeps the
  master of a parameter only where it steps it. Under ZeRO-1/2 (whole parameters owned by one dp
  rank) every other trainable parameter gets a *gradient slot* instead: an fp32 ``nn.Parameter``
  of its shape with no values of its own (one NaN shared by every slot, broadcast with stride 0),
  whose ``.grad`` sums the bf16 gradients in fp32 until they are reduced to the owner. Reading a
  slot gives NaN and writing one raises, so it is never taken for a weight. The owner publishes
  and broadcasts the bf16 values (:class:`autopar.runtime.state.zero.ShardedOptimizer`); checkpoints and
  ``full_state_dict`` fetch the fp32 masters from the owners
  (:meth:`~autopar.runtime.state.zero.ShardedOptimizer.owners_values`). Under ZeRO-3 each master is the
  rank's flat 1/N block of the parameter, as its compute parameter is.

Per parameter a rank holds 2 bytes (bf16 compute copy) + 4 (fp32 gradient) + 4 (fp32 master) and
the optimizer's state on the masters where it steps it (``docs/memory.md``).
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from autopar.ir.graph_names import user_name
from autopar.ir.shard_layout import EXPERTS, ZERO3

__all__ = ["COMPUTE_DTYPES", "fp32_masters", "MasterWeights", "zero3_block",
           "masters_for_rank"]

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fp32_masters(model: nn.Module, targets: list[str], *, param_shards: dict, tp_rank: int,
                 tp_size: int) -> dict[str, torch.Tensor]:
    """{user name: this tp rank's fp32 master} for graph parameter ``targets`` (user names)."""
    masters = {}
    for name in targets:
        original = model.get_parameter(name).detach()
        spec = param_shards.get(name)
        if spec is not None and tp_size > 1:
            original = spec.cut(original, rank=tp_rank, size=tp_size)
        masters[name] = original.to(torch.float32).clone()
    return masters


def zero3_block(tensor: torch.Tensor, *, rank: int, size: int) -> torch.Tensor:
    """ZeRO-3's layout of ``tensor`` on dp rank ``rank``: flattened, zero-padded to a multiple of size, block rank."""
    return ZERO3.cut(tensor.reshape(-1), rank=rank, size=size)


class MasterWeights:
    """fp32 masters of one rank's bf16 compute parameters; gradients accumulate into them in fp32.

    ``stepped``: the trainable parameters this rank steps (ZeRO-1/2's owned ones), None for all.
    The others get a gradient slot instead of a master (module docstring); frozen ones keep theirs.
    """

    def __init__(self, named_compute: list[tuple[str, nn.Parameter]], masters: dict[str, torch.Tensor], *,
                 stepped: set[str] | None = None):
        self.pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        self.slots: set[str] = set()
        self._handles = []
        no_values: dict[torch.device, torch.Tensor] = {}  # what every gradient slot "holds": 4 bytes a device
        for name, compute in named_compute:
            if stepped is not None and compute.requires_grad and name not in stepped:
                empty = no_values.setdefault(compute.device, torch.full((), float("nan"), device=compute.device))
                master = nn.Parameter(empty.expand(compute.shape), requires_grad=True)
                self.slots.add(name)
            else:
                source = masters.get(name)
                if source is None or source.numel() != compute.numel():
                    log.warning("no fp32 original of the same size for %s: its master starts from the bf16 value",
                                name)
                    source = compute.detach().float()
                master = nn.Parameter(source.reshape(compute.shape).to(device=compute.device, dtype=torch.float32).clone(),
                                      requires_grad=compute.requires_grad)
            self.pairs.append((name, compute, master))
            if compute.requires_grad:
                self._handles.append(compute.register_post_accumulate_grad_hook(self._hook(master)))
        self.publish()

    @staticmethod
    def _hook(master: nn.Parameter):
        def accumulate(compute: torch.Tensor) -> None:
            _move_grad(compute, master)
        return accumulate

    @property
    def named(self) -> list[tuple[str, nn.Parameter]]:
        """(name, fp32 master or gradient slot): what gradient sync, ZeRO, clipping and the optimizer work on."""
        return [(name, master) for name, _, master in self.pairs]

    @property
    def masters(self) -> list[nn.Parameter]:
        """The fp32 masters this rank holds (gradient slots left out)."""
        return [master for name, _, master in self.pairs if name not in self.slots]

    @property
    def compute(self) -> dict[str, nn.Parameter]:
        """{name: bf16 compute parameter}: what ZeRO-1/2's owners broadcast after publishing."""
        return {name: compute for name, compute, _ in self.pairs}

    def collect(self) -> None:
        """Move any bf16 gradient still on a compute parameter into its master (fp32)."""
        for _, compute, master in self.pairs:
            if compute.grad is not None:
                _move_grad(compute, master)

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the bf16 compute parameters (after the optimizer step); slots have none."""
        for name, compute, master in self.pairs:
            if name not in self.slots:
                compute.copy_(master.reshape(compute.shape))


def _move_grad(compute: torch.Tensor, master: nn.Parameter) -> None:
    """Add ``compute``'s gradient into ``master`` (fp32), then run the master's post-accumulate-grad
    hooks, as autograd would have: DDP's buckets (runtime/state/ddp_buckets.py) then start during backward."""
    grad = compute.grad.detach().to(torch.float32).reshape(master.shape)
    if master.grad is None:
        master.grad = grad
    else:
        master.grad.add_(grad)
    compute.grad = None
    hooks = getattr(master, "_post_accumulate_grad_hooks", None) or {}
    for hook in tuple(hooks.values()):
        hook(master)


def masters_for_rank(model: nn.Module, lowered, *, schedule, info) -> dict[str, torch.Tensor]:
    """fp32 masters of every parameter of this rank's stages, from the user's fp32 model, cut as the
    program holds them (tensor-parallel shards; this ep rank's experts; ZeRO-3's flat 1/N blocks of the
    parameters it shards)."""
    from autopar.ops.zero3_ops import zero3_shards

    mine = [s for s in lowered.stages if schedule.stage_to_rank[s.stage] == info.coords["pp"]]
    names = list(dict.fromkeys(user_name(t) for s in mine for t in s.param_names))
    shards = {user_name(k): v for k, v in lowered.param_shards.items()}
    masters = fp32_masters(model, names, param_shards=shards, tp_rank=info.coords["tp"], tp_size=info.shape.tp)
    dims = lowered.plan.dims
    if dims.ep > 1:  # MoE experts split over ep ranks of dp: each holds the block of dim 0 at its ep index
        experts = set(lowered.plan.expert_params)
        masters = {n: EXPERTS.cut(t, rank=dims.index("ep", info.coords), size=dims.ep) if n in experts else t
                   for n, t in masters.items()}
    if lowered.plan.zero_stage == 3 and info.dims.dcp > 1:  # the parameters ZeRO-3 shards: their 1/N block
        sharded = {user_name(t): z for t, z in zero3_shards([s.gm for s in mine]).items()}  # experts: over edp
        masters = {n: zero3_block(t, rank=sharded[n].index(dims, info.coords), size=sharded[n].size)
                   if n in sharded else t for n, t in masters.items()}
    return masters
