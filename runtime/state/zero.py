"""The optimizer, with its state sharded across the dp axis (ZeRO) for any torch.optim optimizer.

- ZeRO-0: the plain optimizer over every local parameter.
- ZeRO-1 and ZeRO-2: parameters are *owned whole* by one dp rank each (greedy by size, ties by
  name), so the update is exactly the one the unsharded optimizer computes, whatever the
  optimizer (Adafactor's factored rows, LAMB's per-tensor trust ratio and a factory that picks
  parameter groups by shape all see whole tensors). Gradients are reduced to the owner
  (:mod:`autopar.runtime.state.ddp_buckets`); each rank steps the user's optimizer over the parameters
  it owns; then every owner broadcasts its updated parameters (one flat buffer per owner).
  Under mixed precision the optimizer steps fp32 masters, which exist only for the parameters a
  rank owns (they are optimizer state, as in ZeRO's K = 12 bytes per parameter for Adam): the
  owner rounds its masters into its bf16 compute copies (``publish``) and broadcasts those, half
  the bytes, and exactly what a non-owner would get by rounding the master itself.
- Mixture-of-experts experts split over ep (``local``): under ZeRO-1/2 each is owned whole by one rank
  of its ``edp`` group (the dp/ep ranks holding the same experts; :mod:`autopar.runtime.state.moe_groups`),
  partitioned as the dp partition is (greedy by size) over edp, and its owner broadcasts it over edp
  after the step. With dp == ep (edp of one rank) every holder steps its experts.
- ZeRO-3: the parameters themselves are flat 1/N shards (:mod:`autopar.passes.data_parallel.zero3`), so each
  rank steps its shards and nothing is broadcast. An optimizer on flat shards computes the
  unsharded update only if it treats every element on its own, so ZeRO-3 accepts the
  element-wise optimizers of torch.optim (:data:`ELEMENTWISE`) and refuses others with a
  :class:`~autopar.errors.PlanError` that says to use ZeRO-2.

Whatever the stage, :class:`ShardedOptimizer` is a ``torch.optim.Optimizer`` whose ``param_groups`` are
the factory's groups over the whole model (:mod:`autopar.runtime.state.param_groups`, decided by name on
stand-ins of the model's full shapes): every rank has the same groups and settings, each holding the
tensors of that group it steps (owned parameters, flat shards, experts, fp32 masters), and every step
copies the groups' settings into the inner optimizer, so a learning-rate scheduler on
``program.optimizer`` holds for every shard.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from autopar.errors import PlanError
from autopar.ops import comm_audit as comm
from autopar.parallel_dims import ParallelDims
from autopar.runtime.state.param_groups import GroupTemplate, group_template, settings_of
from autopar.runtime.execution.rank_context import AxisGroup

__all__ = ["ShardedOptimizer", "partition_params", "owned_experts", "stepped_here", "ELEMENTWISE", "check_elementwise"]

log = logging.getLogger(__name__)

#: torch.optim optimizers whose update of an element depends on that element alone.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
               "ASGD", "Rprop")


def partition_params(named: list[tuple[str, torch.nn.Parameter]], num_parts: int) -> list[list[str]]:
    """Names per part, balancing element counts greedily (largest first, ties by name)."""
    parts: list[list[str]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for name, p in sorted(named, key=lambda kv: (-kv[1].numel(), kv[0])):
        k = min(range(num_parts), key=lambda i: (loads[i], i))
        parts[k].append(name)
        loads[k] += p.numel()
    return parts


def owned_experts(experts: list[tuple[str, torch.nn.Parameter]], *, dims: ParallelDims,
                  coords: dict[str, int]) -> set[str]:
    """ZeRO-1/2's expert-owner rule: the expert tensors (MoE experts split over ep) the rank at mesh
    coordinates ``coords`` steps. They are partitioned over its edcp group (the edp x cp ranks holding the
    same experts, each other tokens; edp without cp) as the dp partition is, and it owns the part at its
    edcp index. (The memory calculator and :class:`ShardedOptimizer` read this rule; with edcp of one rank,
    every holder steps its experts.)"""
    return set(partition_params(experts, dims.edcp)[dims.index("edcp", coords)])


def stepped_here(named: list[tuple[str, torch.nn.Parameter]], *, zero_stage: int, dims: ParallelDims,
                 coords: dict[str, int], local: frozenset[str] = frozenset()) -> set[str] | None:
    """Names of the trainable parameters the rank at ``coords`` steps under ZeRO-1/2; None when it steps all.

    ``local`` parameters (MoE experts split over ep ranks of dp) follow :func:`owned_experts`."""
    if zero_stage not in (1, 2) or dims.dcp == 1:  # (over dp x cp: the ranks a gradient is summed over)
        return None
    trainable = [(n, p) for n, p in named if p.requires_grad]
    shared = [(n, p) for n, p in trainable if n not in local]
    experts = [(n, p) for n, p in trainable if n in local]
    return set(partition_params(shared, dims.dcp)[dims.index("dcp", coords)]) | \
        owned_experts(experts, dims=dims, coords=coords)


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Raise PlanError unless ``optimizer`` is one of torch.optim's element-wise optimizers."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE:
        return
    raise PlanError(f"zero_stage=3 steps flat 1/N shards of every parameter, which is exact only for "
                    f"element-wise optimizers; {cls.__module__}.{cls.__name__} is not one of "
                    f"torch.optim's {', '.join(ELEMENTWISE)}",
                    where="compile(optimizer=...) with zero_stage=3",
                    fix="use zero_stage=2 (whole parameters per rank: exact for any optimizer) "
                        "or an element-wise optimizer")


class ShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer over this rank's share of the parameters (``zero_stage`` 0-3), as one torch optimizer.

    ``param_groups`` are the optimizer's groups as the factory made them over the whole model
    (:mod:`autopar.runtime.state.param_groups`): the same groups, order and settings on every rank, each holding
    the parameters of that group this rank steps (maybe none). They are the source of truth: a scheduler
    or the user reads and sets ``lr``, ``weight_decay``, ``betas``, ... there, and every step copies the
    settings into the groups of the inner optimizer (``self.optimizer``: the user's class over the same
    tensors), so they hold for every shard of the group's parameters. ``state`` is the inner optimizer's,
    so torch's ``state_dict()`` / ``load_state_dict()`` work on this rank's share (same mesh);
    checkpoints move the state across meshes by name. ``step()`` runs only inside the program's
    ``train_step`` (:meth:`stepping`): called by hand, after a step that already stepped, it raises.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 factory: Callable[[list], torch.optim.Optimizer], *, zero_stage: int,
                 dp: AxisGroup, comm_log: comm.CommLog | None = None,
                 publish: Callable[[], None] | None = None, synced: dict[str, torch.Tensor] | None = None,
                 local: frozenset[str] = frozenset(), edp: AxisGroup | None = None,
                 template: GroupTemplate | None = None, aliases: Mapping[str, Sequence[str]] | None = None):
        """``publish`` runs after the local step, before the owners' broadcast (mixed precision rounds the
        masters into the compute copies there); ``synced`` are the tensors the owners broadcast, by name
        (default: the parameters; the bf16 compute copies under mixed precision). ``local``: parameters every
        rank steps itself, outside the dp partition (MoE experts split over ep: runtime/state/moe_groups.py); under
        ZeRO-1/2 they are partitioned over ``edp`` (the ranks holding the same experts: the ``edcp`` axis, edp x cp,
        with context parallelism) when it has several ranks.
        ``template``: the factory's groups over the whole model (None: those of this rank's parameters);
        ``aliases``: every name of a tied weight, by the name used here."""
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        steps_all = [(n, p) for n, p in named_params if n in local]
        self.named = [(n, p) for n, p in named_params if n not in local]
        self.publish = publish
        self.zero_stage = zero_stage
        self.dp_group, self.dp_ranks, self.dp_rank = dp.group, list(dp.ranks), dp.index
        self.comm_log = comm_log
        sharded = zero_stage in (1, 2) and dp.size > 1
        self.owners = partition_params(self.named, dp.size) if sharded else [[n for n, _ in self.named]]
        self.edp = edp if sharded and edp is not None and edp.size > 1 else None
        self.expert_owners = partition_params(steps_all, self.edp.size) if self.edp else [[n for n, _ in steps_all]]
        self.named += steps_all
        by_name = dict(self.named)
        mine = (self.owners[dp.index] if sharded else self.owners[0]) + \
            self.expert_owners[self.edp.index if self.edp else 0]
        self.local_names = mine
        self.sharded = sharded
        self._by_name = by_name
        self._synced = synced
        self._stepping, self._step_settings = False, None
        template = template if template is not None else group_template(factory, self.named, named=False)
        aliases = aliases or {}
        group_of = {n: template.group_of(n, aliases.get(n, ())) for n in mine}
        members = [[n for n in mine if group_of[n] == k] for k in range(len(template.settings))]
        self._stepped = [n for n in mine if group_of[n] is not None]  # a name in no group is not stepped
        self.groups_here = [k for k, names in enumerate(members) if names]  # inner group j is group groups_here[j]
        self.optimizer = self._inner(factory, template, members) if self.groups_here else None
        if zero_stage == 3 and dp.size > 1 and self.optimizer is not None:
            check_elementwise(self.optimizer)
        self._built = False
        super().__init__([self._group(template, k, names) for k, names in enumerate(members)],
                         dict(template.defaults))
        self._built = True
        self._link()

    def add_param_group(self, param_group: dict) -> None:
        """torch's, while the groups are built; afterwards refused (a group only the wrapper had would not train)."""
        if getattr(self, "_built", False):
            raise PlanError("program.optimizer cannot take new parameter groups after compile: the groups are the "
                            "optimizer factory's, over every shard of the model",
                            where="program.optimizer.add_param_group", fix="build the groups in the optimizer factory")
        super().add_param_group(param_group)

    def _group(self, template: GroupTemplate, k: int, names: list[str]) -> dict:
        """Group ``k`` of the template over this rank's tensors ``names``."""
        group = {**template.settings[k], "params": [self._by_name[n] for n in names]}
        if template.keeps_names:
            group["param_names"] = list(names)
        return group

    def _inner(self, factory, template: GroupTemplate, members: list[list[str]]) -> torch.optim.Optimizer:
        """The user's optimizer over this rank's stepped tensors, its groups set to the template's non-empty ones."""
        local = [(n, self._by_name[n]) for names in members for n in names]
        inner = factory(local if template.named else [p for _, p in local])
        inner.param_groups = [self._group(template, k, members[k]) for k in self.groups_here]
        return inner

    def _link(self) -> None:
        """One state for both: the inner optimizer's (torch's ``state_dict`` packs it by the groups here)."""
        if self.optimizer is not None:
            self.state = self.optimizer.state

    # -- stepping ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stepping(self, settings: list[dict] | None = None):
        """Allow ``step()`` for the duration (the program's own step); ``settings``: each group's settings to
        step with instead of ``param_groups``' (the asynchronous schedules' per-batch snapshots)."""
        self._stepping, self._step_settings = True, settings
        try:
            yield
        finally:
            self._stepping, self._step_settings = False, None

    def apply_settings(self, settings: list[dict] | None = None) -> None:
        """Copy each group's settings (``param_groups``', or ``settings``) into the inner optimizer's groups."""
        if self.optimizer is None:
            return
        source = self.param_groups if settings is None else settings
        for inner_group, k in zip(self.optimizer.param_groups, self.groups_here, strict=True):
            inner_group.update(settings_of(source[k]))

    def step(self, closure=None) -> None:
        """Step this rank's parameters with the groups' settings, publish them (mixed precision), and broadcast
        them from their owners. Only inside the program's step (:meth:`stepping`)."""
        if not self._stepping or closure is not None:
            raise PlanError("program.optimizer.step() was called outside the program's step: train_step already "
                            "steps the optimizer (a second call would apply the same gradients again)",
                            where="program.optimizer.step()",
                            fix="drop the call; after program.train_step(...) a loop only steps its scheduler")
        if self.optimizer is not None:
            self.apply_settings(self._step_settings)
            self.optimizer.step()
        self.publish_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of the rank (stepped here or not)."""
        for _, p in self.named:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def owner_of(self) -> dict[str, int] | None:
        """{parameter name: dp index that owns it} under ZeRO-1/2; None when nothing is owned whole."""
        if not self.sharded:
            return None
        return {n: k for k, names in enumerate(self.owners) for n in names}

    def expert_owner_of(self) -> dict[str, int] | None:
        """{expert tensor name: edp index that owns it} when ZeRO-1/2 partition the experts over edp; else None."""
        if self.edp is None:
            return None
        return {n: k for k, names in enumerate(self.expert_owners) for n in names}

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose (dp-reduced) gradient this rank holds and steps.

        Every parameter under ZeRO-0; the owned ones under ZeRO-1/2; the local shards under ZeRO-3.
        A global gradient norm sums the squares of exactly these over dp.
        """
        return [self._by_name[n] for n in self.local_names]

    def publish_parameters(self) -> None:
        """Make every rank's copies current after this rank's parameters changed (a step, a load)."""
        if self.publish is not None:
            self.publish()
        if self.sharded:
            synced = self._synced if self._synced is not None else {n: p.data for n, p in self.named}
            self._broadcast_owned(synced, log=self.comm_log, purpose="param_broadcast")
            self._broadcast_experts(synced, log=self.comm_log, purpose="param_broadcast")

    def owners_values(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``named`` with each trainable tensor this rank does not step replaced by a copy of its owner's
        (ZeRO-1/2; collective over dp): under mixed precision only owners hold a parameter's fp32 master."""
        if not self.sharded:
            return list(named)
        mine = set(self.local_names)
        values = {n: t if n in mine else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                  for n, t in named if n in self._by_name}
        self._broadcast_owned(values, log=None, purpose="state_dict")
        self._broadcast_experts(values, log=None, purpose="state_dict")
        return [(n, values.get(n, t)) for n, t in named]

    def _broadcast_owned(self, tensors: dict[str, torch.Tensor], *, log, purpose: str) -> None:
        """Each owner's ``tensors`` into the same-named tensors of the other dp ranks (one flat buffer per owner)."""
        _broadcast_parts(tensors, self.owners, ranks=self.dp_ranks, group=self.dp_group, index=self.dp_rank,
                         log=log, purpose=purpose)

    def _broadcast_experts(self, tensors: dict[str, torch.Tensor], *, log, purpose: str) -> None:
        """Each edp owner's expert ``tensors`` into the other ranks of the edp group (the same experts)."""
        if self.edp is not None:
            _broadcast_parts(tensors, self.expert_owners, ranks=list(self.edp.ranks), group=self.edp.group,
                             index=self.edp.index, log=log, purpose=purpose)

    # -- torch's state_dict of this rank's share (same mesh); checkpoints use the named forms below ----
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (groups' settings and this rank's state, checked against the groups), into both."""
        super().load_state_dict(state_dict)
        if self.optimizer is not None:
            self.optimizer.state = self.state
        self.apply_settings()

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the ZeRO saving, measurable)."""
        if self.optimizer is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    # -- checkpoints (autopar.runtime.checkpoints.checkpoint): the state of each parameter this rank steps, by name --
    def stepped_names(self) -> list[str]:
        """Names of the parameters this rank's optimizer steps (their state lives here)."""
        return list(self._stepped)

    def named_state(self) -> dict[str, dict]:
        """{parameter name: its optimizer state ({'exp_avg': tensor, 'step': tensor, ...})}."""
        if self.optimizer is None:
            return {}
        return {n: dict(self.optimizer.state[self._by_name[n]]) for n in self.local_names
                if self._by_name[n] in self.optimizer.state}

    def hyperparameters(self) -> list[dict]:
        """Each parameter group's settings (lr, betas, initial_lr, ...), the same on every rank."""
        return [settings_of(g) for g in self.param_groups]

    def load_named_state(self, states: dict[str, dict], hyperparameters: list[dict] | None = None) -> None:
        """Set the state of the parameters this rank steps from ``named_state``'s form (through the inner
        optimizer's own ``load_state_dict``), and each group's settings from ``hyperparameters``."""
        if hyperparameters is not None:
            assert len(hyperparameters) == len(self.param_groups), "checked by load_checkpoint"
            for group, saved in zip(self.param_groups, hyperparameters):
                for key, value in saved.items():
                    group[key] = _like(group.get(key), value)
        if self.optimizer is None:
            return
        current = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        state = {index[id(self._by_name[n])]: s for n, s in states.items()
                 if n in self._by_name and id(self._by_name[n]) in index}
        self.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
        self._link()
        self.apply_settings()


def _like(current, value):
    """A saved setting in the type of the current one: JSON's lists as tuples (betas), a tensor filled in place."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
        return current.fill_(value)
    return value


@torch.no_grad()
def _broadcast_parts(tensors: dict[str, torch.Tensor], parts: list[list[str]], *, ranks: list[int], group,
                     index: int, log, purpose: str) -> None:
    """Each part's ``tensors`` from the rank owning it (``ranks[k]`` owns ``parts[k]``) into the others'."""
    for owner_index, names in enumerate(parts):
        if not names:
            continue
        chosen = [tensors[n] for n in names]
        flat = torch.cat([t.detach().reshape(-1) for t in chosen])
        comm.broadcast(flat, src=ranks[owner_index], group=group, size=len(ranks), log=log, purpose=purpose)
        if owner_index != index:
            offset = 0
            for t in chosen:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
