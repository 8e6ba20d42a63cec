"""The optimizer's parameter groups, learned once from the user's factory over the whole model.

A rank steps only its share of the model (tensor-parallel shards, its pipeline stages, the parameters
ZeRO-1/2 make it own, ZeRO-3's flat 1/N blocks, its experts), so the factory cannot simply be handed
the model's parameters as on one device. Groups are therefore decided once, by name, for the whole
model:

1. :func:`group_template` calls the factory with *stand-ins* of every parameter of the model, in
   ``model.named_parameters()`` order (a tied weight once, under its first name): meta tensors of the
   model's shapes, dtypes and ``requires_grad``, so nothing is allocated and a factory that picks groups
   by shape (``p.ndim < 2``) sees whole tensors. With ``optimizer_params="params"`` it receives the
   tensors, with ``"named"`` the ``(name, tensor)`` pairs (torch's optimizers then keep
   ``param_names``). The groups it makes are the :class:`GroupTemplate`: each group's settings (lr,
   weight_decay, betas, ...) and the model name of each member.
2. Each rank's :class:`autopar.runtime.state.zero.ShardedOptimizer` puts every parameter it steps into the
   group of its name (:meth:`GroupTemplate.group_of`; a tied weight by any of its names), so every shard
   of a parameter is in its group on every rank and layout, and every rank has the same groups, in the
   same order, with the same settings: what a learning-rate scheduler reads and writes.

A trainable parameter the factory put in no group is not stepped, as on one device. A factory that
builds its optimizer from tensors it was not given (``lambda _: AdamW(model.parameters())``) is a
:class:`~autopar.errors.PlanError`: it would train the user's model, not the program.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> def factory(named):
    ...     decay = [p for n, p in named if n.endswith("0.weight")]
    ...     rest = [p for n, p in named if not n.endswith("0.weight")]
    ...     return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
    ...                               {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    >>> template = group_template(factory, model.named_parameters(), named=True)
    >>> [g["weight_decay"] for g in template.settings], template.group_of("1.bias")
    ([0.1, 0.0], 1)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from autopar.errors import PlanError

__all__ = ["GroupTemplate", "group_template", "NOT_SETTINGS", "settings_of"]

#: keys of a torch parameter group that are not settings (the tensors and their names)
NOT_SETTINGS = ("params", "param_names")


def settings_of(group: Mapping) -> dict:
    """A parameter group's settings (lr, betas, ...), without its tensors and their names."""
    return {k: v for k, v in group.items() if k not in NOT_SETTINGS}


@dataclass(frozen=True)
class GroupTemplate:
    """The factory's parameter groups over the whole model: settings per group, group per model name."""

    settings: tuple[dict, ...]  # each group's settings, in the factory's order
    members: Mapping[str, int]  # model parameter name -> its group
    names: frozenset[str]  # every name the factory was shown (members or not)
    named: bool  # the factory takes (name, tensor) pairs
    keeps_names: bool  # its groups carry "param_names" (torch's optimizers given named tensors)
    defaults: dict  # the optimizer's defaults

    def group_of(self, name: str, aliases: Sequence[str] = ()) -> int | None:
        """The group of the parameter called ``name`` (or any of ``aliases``: the names of a tied weight),
        None when the factory put it in no group (it is not stepped)."""
        known = [a for a in dict.fromkeys((name, *aliases)) if a in self.names]
        if not known:
            raise PlanError(f"parameter {name!r} (names {[name, *aliases]}) was not among the parameters the "
                            "optimizer factory was shown", where="building the optimizer's parameter groups",
                            fix="this is a bug in autopar's naming of parameters: report it with the model")
        groups = {a: self.members[a] for a in known if a in self.members}
        if len(set(groups.values())) > 1:
            listed = ", ".join(f"{a!r} in group {k}" for a, k in groups.items())
            raise PlanError(f"parameter {name!r} is one tensor under several names that the optimizer factory put "
                            f"in different parameter groups ({listed}): its shards could not all follow one group",
                            where="compile(optimizer=...)",
                            fix="give every name of a tied weight the same group (decide by one of its names)")
        return next(iter(groups.values()), None)


def _stand_in(tensor: torch.Tensor) -> torch.nn.Parameter:
    """A meta tensor of ``tensor``'s shape and dtype, as a parameter with its ``requires_grad``."""
    return torch.nn.Parameter(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"),
                              requires_grad=tensor.requires_grad)


def group_template(factory: Callable, named_params: Iterable[tuple[str, torch.Tensor]], *,
                   named: bool) -> GroupTemplate:
    """Call ``factory`` once on stand-ins of ``named_params`` (the model's ``named_parameters()``) and read its
    groups; ``named``: pass ``(name, tensor)`` pairs instead of tensors."""
    stand_ins = [(name, _stand_in(p)) for name, p in named_params]
    try:
        probe = factory(stand_ins if named else [p for _, p in stand_ins])
    except Exception as exc:  # noqa: BLE001 - the user's factory: say what autopar gave it
        given = "(name, parameter) pairs" if named else "parameters"
        raise PlanError(f"the optimizer factory raised {type(exc).__name__}: {exc} when called with {given} of the "
                        "model's shapes on the meta device (how autopar learns its parameter groups)",
                        where="compile(optimizer=...)",
                        fix="build the optimizer from the argument alone; with optimizer_params='named' it is a "
                            "list of (name, parameter) pairs, else a list of parameters") from exc
    groups = getattr(probe, "param_groups", None)
    if not isinstance(groups, list) or not groups:
        raise PlanError(f"the optimizer factory returned {type(probe).__name__}, which has no param_groups",
                        where="compile(optimizer=...)", fix="return a torch.optim.Optimizer")
    by_id = {id(p): name for name, p in stand_ins}
    members: dict[str, int] = {}
    for k, group in enumerate(groups):
        for p in group["params"]:
            if id(p) not in by_id:
                raise PlanError(f"the optimizer's parameter group {k} holds a tensor of shape {tuple(p.shape)} that "
                                "the factory was not given (its own model's parameters?): the program would not "
                                "train", where="compile(optimizer=...)",
                                fix="build the optimizer only from the parameters the factory receives")
            members[by_id[id(p)]] = k
    return GroupTemplate(settings=tuple(settings_of(g) for g in groups), members=members,
                         names=frozenset(by_id.values()), named=named, keeps_names="param_names" in groups[0],
                         defaults=dict(getattr(probe, "defaults", {})))
