"""Pipeline schedules as data: an :class:`Action` is one step, a :class:`Schedule` one list of them per rank.

An action prints as ``<stage><kind><microbatch>`` and parses back::

    >>> from autopar.runtime.schedules.action import Action, ActionKind
    >>> str(Action(1, ActionKind.F, 3))
    '1F3'
    >>> Action.parse("1F3") == Action(1, ActionKind.F, 3)
    True

A schedule round-trips through CSV (one row per rank, one cell per action), which is what golden
tests compare against.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Collection, Iterable, Sequence

from autopar.errors import ScheduleError

__all__ = ["ActionKind", "Action", "Schedule"]

_ACTION_RE = re.compile(r"^(\d+)([A-Z])(\d+)$")
_ACTION_FORMAT_FIX = "write an action as <stage><kind><microbatch>, e.g. '1F3'; kinds are F, B and W"


class ActionKind(str, enum.Enum):
    """What an action computes for its (stage, microbatch)."""

    F = "F"
    """Forward."""
    B = "B"
    """Backward: the full backward, or only the input gradient when the schedule splits backward."""
    W = "W"
    """Weight gradient; present only when the schedule splits backward."""

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a schedule: compute ``kind`` for ``microbatch`` on ``stage``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if type(self.kind) is ActionKind and type(self.stage) is int and type(self.microbatch) is int \
                and self.stage >= 0 and self.microbatch >= 0:
            return  # the common case, checked at once (schedules are built of many thousand actions)
        if not isinstance(self.kind, ActionKind):
            try:
                object.__setattr__(self, "kind", ActionKind(self.kind))
            except ValueError:
                raise ScheduleError(
                    f"unknown action kind {self.kind!r}", fix=_ACTION_FORMAT_FIX
                ) from None
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(
                    f"action {field} must be an int >= 0, got {value!r}",
                    where=f"Action(stage={self.stage!r}, kind={self.kind}, microbatch={self.microbatch!r})",
                    fix=f"pass a non-negative integer {field}",
                )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the short form written by ``str(action)``, e.g. ``"1F3"``."""
        match = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if match is None or match.group(2) not in ActionKind.__members__:
            raise ScheduleError(f"cannot parse action {text!r}", fix=_ACTION_FORMAT_FIX)
        return cls(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


def _as_tuple_of_ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    """Coerce ``values`` to a tuple of ints, or raise a ScheduleError naming ``name``."""
    result = tuple(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in result):
        raise ScheduleError(f"schedule {name} must hold ints, got {result!r}")
    return result


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the facts needed to check and run them.

    ``stage_to_rank[s]`` is the rank that runs stage ``s``; ``actions[r]`` is rank ``r``'s actions in
    execution order. Construction checks only the shape; :func:`~autopar.runtime.schedules.validator.validate`
    checks counts, placement, order and deadlock freedom.

    ``num_replicas > 1`` (Chimera) means the model is held that many times: the stages form
    ``num_replicas`` chains of ``num_stages // num_replicas`` stages (replica ``k`` is stages
    ``k * parts .. (k + 1) * parts - 1``, stage ``s`` running model part ``s % parts``), and
    microbatch ``i`` goes through the chain of replica ``microbatch_replica[i]`` only.
    ``forward_only`` schedules (inference) hold F actions only. ``staleness`` is set on the
    asynchronous schedules: the weight-version rule (a
    :class:`~autopar.runtime.schedules.staleness.StalenessRule`) their runtime follows.
    ``overlapped[r]`` (DualPipeV) holds the indices in rank ``r``'s list of each F that forms an
    overlapped pair with the B right after it; the pair prints as one cell, ``0F5&3B1``.
    ``full_backward`` (DualPipe, DualPipeV): a B followed at once by its own W is one full backward,
    the schedule's definition of it, and runs as one (its input gradient leaves with its weight
    gradients done); in a zero-bubble schedule such a pair is only adjacency, and its B's gradient
    leaves before its W's work, as the schedule times it.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    num_replicas: int = 1
    microbatch_replica: tuple[int, ...] = ()
    forward_only: bool = False
    staleness: object = None
    overlapped: tuple[tuple[int, ...], ...] = ()
    full_backward: bool = False
    #: facts derived from the schedule by the modules that read it, computed once per schedule (not a field of
    #: its identity: not compared, not copied by ``dataclasses.replace``); e.g. deps.needs
    memo: dict = dataclasses.field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", _as_tuple_of_ints("stage_to_rank", self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        object.__setattr__(self, "microbatch_replica",
                           _as_tuple_of_ints("microbatch_replica", self.microbatch_replica))
        for field in ("num_ranks", "num_stages", "num_microbatches"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(
                    f"{field} must be an int >= 1, got {value!r}", where=f"schedule {self.name!r}"
                )
        if len(self.stage_to_rank) != self.num_stages:
            raise ScheduleError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages",
                where=f"schedule {self.name!r}",
                fix="give one owning rank per stage",
            )
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ScheduleError(
                f"stage_to_rank names ranks {bad} outside 0..{self.num_ranks - 1}",
                where=f"schedule {self.name!r}",
            )
        if len(self.actions) != self.num_ranks:
            raise ScheduleError(
                f"actions has {len(self.actions)} rows for {self.num_ranks} ranks",
                where=f"schedule {self.name!r}",
                fix="give one action list per rank",
            )
        if not all(isinstance(a, Action) for row in self.actions for a in row):
            raise ScheduleError("every entry of actions must be an Action", where=f"schedule {self.name!r}")
        self._check_replicas()
        self._check_overlapped()

    def _check_overlapped(self) -> None:
        object.__setattr__(self, "overlapped", tuple(_as_tuple_of_ints("overlapped", row) for row in self.overlapped))
        if not self.overlapped:
            return
        if len(self.overlapped) != self.num_ranks:
            raise ScheduleError(f"overlapped has {len(self.overlapped)} rows for {self.num_ranks} ranks",
                                where=f"schedule {self.name!r}", fix="give one (possibly empty) row per rank")
        for rank, (row, starts) in enumerate(zip(self.actions, self.overlapped)):
            for i in starts:
                if not (0 <= i < len(row) - 1 and row[i].kind is ActionKind.F and row[i + 1].kind is ActionKind.B
                        and row[i].stage != row[i + 1].stage):
                    raise ScheduleError(
                        f"overlapped pair at index {i} of rank {rank} is not a forward followed by a backward "
                        f"of another stage", where=f"schedule {self.name!r}, rank {rank}",
                        fix="mark only an F whose next action is a B on the rank's other stage")

    def cells(self, rank: int) -> list[str]:
        """Rank ``rank``'s actions as printed: one cell per action, an overlapped pair as ``F&B``."""
        return [c.strip() for c in self._marked_cells(rank, ())]

    def _check_replicas(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1 \
                or self.num_stages % self.num_replicas:
            raise ScheduleError(
                f"num_replicas must be an int >= 1 dividing num_stages={self.num_stages}, got {self.num_replicas!r}",
                where=f"schedule {self.name!r}",
            )
        routes = self.microbatch_replica
        if routes and (len(routes) != self.num_microbatches or any(not 0 <= k < self.num_replicas for k in routes)):
            raise ScheduleError(
                f"microbatch_replica must give one replica in 0..{self.num_replicas - 1} per microbatch, "
                f"got {routes!r}",
                where=f"schedule {self.name!r}",
            )
        if self.num_replicas > 1 and not routes:
            raise ScheduleError(f"a schedule with {self.num_replicas} replicas needs microbatch_replica",
                                where=f"schedule {self.name!r}", fix="give the replica each microbatch goes through")

    @property
    def parts(self) -> int:
        """Stages per replica: the number of pieces the model is cut into."""
        return self.num_stages // self.num_replicas

    def replica_of(self, microbatch: int) -> int:
        """The replica (chain of stages) ``microbatch`` goes through."""
        return self.microbatch_replica[microbatch] if self.microbatch_replica else 0

    def chain(self, microbatch: int) -> range:
        """The stages ``microbatch`` goes through, in forward order."""
        start = self.replica_of(microbatch) * self.parts
        return range(start, start + self.parts)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def format(self, *, marks: Collection[tuple[int, int]] = ()) -> str:
        """A readable grid, one line per rank; ``marks`` holds (rank, index) cells to wrap in ``[ ]``."""
        grid = [self._marked_cells(rank, marks) for rank in range(self.num_ranks)]
        width = max((len(c) for row in grid for c in row), default=5)
        label_width = len(f"rank {self.num_ranks - 1}")
        lines = [self._header()]
        for rank, row in enumerate(grid):
            lines.append(f"{f'rank {rank}'.ljust(label_width)} |{''.join(c.rjust(width) for c in row).rstrip()}")
        return "\n".join(lines)

    def _marked_cells(self, rank: int, marks: Collection[tuple[int, int]]) -> list[str]:
        """:meth:`cells` padded by a space each side, or wrapped in ``[ ]`` when one of its actions is marked."""
        starts = set(self.overlapped[rank]) if self.overlapped else set()
        row, out, i = self.actions[rank], [], 0
        while i < len(row):
            size = 2 if i in starts else 1
            text = "&".join(str(a) for a in row[i:i + size])
            marked = any((rank, j) in marks for j in range(i, i + size))
            out.append(f"[{text}]" if marked else f" {text} ")
            i += size
        return out

    def _header(self) -> str:
        return (
            f"schedule {self.name!r}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches" + (", split backward" if self.split_backward else "")
            + (f", {self.num_replicas} replicas" if self.num_replicas > 1 else "")
            + (", forward only" if self.forward_only else "")
            + (", overlapped F&B pairs" if self.overlapped else "")
        )

    def to_csv(self) -> str:
        """One row per rank, one cell per action string (``F&B`` for an overlapped pair); see :meth:`from_csv`."""
        return "".join(",".join(self.cells(rank)) + "\n" for rank in range(self.num_ranks))

    @classmethod
    def from_csv(cls, text: str, **meta: object) -> Schedule:
        """Read :meth:`to_csv` output; ``meta`` may give any field, the rest is inferred from the actions.

        Inferred: ``num_ranks`` (rows), ``num_stages`` and ``num_microbatches`` (largest index + 1),
        ``stage_to_rank`` (the row each stage appears in), ``split_backward`` (any W present),
        ``name`` ("custom"), ``overlapped`` (the cells written ``F&B``); ``num_replicas``,
        ``microbatch_replica``, ``forward_only``, ``staleness`` and ``full_backward`` keep their
        defaults unless given.
        """
        known = {f.name for f in dataclasses.fields(cls) if f.init} - {"actions"}
        unknown = sorted(set(meta) - known)
        if unknown:
            raise ScheduleError(
                f"unknown schedule fields {unknown}", where="Schedule.from_csv", fix=f"use only {sorted(known)}"
            )
        lines = text.strip("\n").split("\n") if text.strip() else []
        parsed = [_parse_row(line) for line in lines]
        rows = [row for row, _ in parsed]
        num_ranks = meta.get("num_ranks", len(rows))
        rows += [()] * max(0, int(num_ranks) - len(rows))  # type: ignore[arg-type]
        pairs = [starts for _, starts in parsed] + [()] * (len(rows) - len(parsed))
        flat = [a for row in rows for a in row]
        num_stages = meta.get("num_stages", max((a.stage for a in flat), default=0) + 1)
        fields = {
            "name": meta.get("name", "custom"),
            "num_ranks": num_ranks,
            "num_stages": num_stages,
            "num_microbatches": meta.get("num_microbatches", max((a.microbatch for a in flat), default=0) + 1),
            "split_backward": meta.get("split_backward", any(a.kind is ActionKind.W for a in flat)),
        }
        if any(pairs):
            fields["overlapped"] = tuple(pairs)
        fields.update({k: meta[k] for k in ("num_replicas", "microbatch_replica", "forward_only", "staleness",
                                            "overlapped", "full_backward") if k in meta})
        stage_to_rank = meta.get("stage_to_rank")
        if stage_to_rank is None:
            stage_to_rank = _infer_stage_to_rank(rows, int(num_stages))  # type: ignore[arg-type]
        return cls(stage_to_rank=stage_to_rank, actions=tuple(rows), **fields)  # type: ignore[arg-type]


def _parse_row(line: str) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """One CSV row: its actions, and the index of each overlapped pair's F (cells written ``F&B``)."""
    actions: list[Action] = []
    starts: list[int] = []
    for cell in (c for c in line.split(",") if c.strip()):
        parts = cell.split("&")
        if len(parts) > 2:
            raise ScheduleError(f"cannot parse cell {cell!r}: a pair joins exactly two actions",
                                where="Schedule.from_csv", fix="write an overlapped pair as 'F&B', e.g. '0F5&3B1'")
        if len(parts) == 2:
            starts.append(len(actions))
        actions.extend(Action.parse(p) for p in parts)
    return tuple(actions), tuple(starts)


def _infer_stage_to_rank(rows: Sequence[Sequence[Action]], num_stages: int) -> tuple[int, ...]:
    """The one rank each stage appears on, or a ScheduleError asking for ``stage_to_rank``."""
    owners: dict[int, set[int]] = {}
    for rank, row in enumerate(rows):
        for action in row:
            owners.setdefault(action.stage, set()).add(rank)
    result = []
    for stage in range(num_stages):
        ranks = owners.get(stage, set())
        if len(ranks) != 1:
            raise ScheduleError(
                f"cannot infer the rank of stage {stage}: it appears on ranks {sorted(ranks)}",
                where="Schedule.from_csv",
                fix="pass stage_to_rank=... explicitly",
            )
        result.append(ranks.pop())
    return tuple(result)
