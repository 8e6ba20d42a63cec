"""A deadline on every collective the runtime issues, and autopar's error when one is missed.

Gloo waits for a collective whose peer never comes for the *group's* timeout: 30 minutes by
default, and the subgroups a DeviceMesh makes get that default whatever ``init_process_group``
was given. So a rank that skipped an all-reduce (it raised, it runs another schedule, it died
without its socket closing) would hang its peers for half an hour. Instead the runtime issues
each collective asynchronously and waits on it for at most ``p2p_timeout_s`` (the same option
as the pipeline's p2p waits, :mod:`autopar.ops.p2p`); a missed deadline or a failed peer
raises :class:`autopar.errors.RuntimeCommError` naming this rank, the stage and action running
(or the phase of the step), the collective, its purpose and the global ranks of its group, and
what to do.

This holds whoever made the process groups (``autopar.init_mesh`` or the user's own
``init_process_group``/``DeviceMesh``): the deadline is autopar's wait, not the group's setting.
On NCCL (a CUDA group) the wait is not timed, because a timed wait blocks the CPU until the GPU
has finished and would end the overlap of communication with compute; there the group's own
timeout and NCCL's watchdog bound the wait (``autopar.init_mesh(timeout_s=...)`` sets it for
the groups autopar makes), and their errors are still turned into RuntimeCommError here.
Object collectives (``all_gather_object``, ``broadcast_object_list``, used for checkpoints'
agreement and for gathering results) have no asynchronous form: they are bounded by the group's
timeout, and only their errors are translated.

After a timeout the group is unusable (the peer that arrives late pairs with nothing): the step
is lost, and the job should stop and resume from its last checkpoint (docs/checkpoints.md).

With a flight record (:mod:`autopar.ops.flight_record`), each collective is an entry (op,
purpose, group, its number in the group), marked waiting while this rank blocks in it and done or
failed after; ``on_failure`` (the job-wide watch, :mod:`autopar.runtime.diagnostics.flight_watch`) runs the
diagnosis before the error is raised, and its one-line summary joins the error's message.

Example::

    >>> guard = CommGuard(rank=0, timeout_s=3.0)
    >>> guard.timeout_s
    3.0
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from autopar.errors import AutoparError, RuntimeCommError

__all__ = ["CommGuard", "GuardedWork", "group_ranks"]


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the world)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _timed(group) -> bool:
    """Gloo collectives are waited on with a deadline; NCCL's wait would block the CPU (module doc)."""
    return "nccl" not in str(dist.get_backend(group)).lower()


@dataclass
class CommGuard:
    """This rank's deadline for its collectives and the error naming a missed one."""

    rank: int
    timeout_s: float
    place: Callable[[], str] = field(default=lambda: "")  # the stage and action running, or the phase
    flight: object = None  # this rank's FlightRecord (ops/flight_record.py), or None
    on_failure: Callable[[str], str] | None = None  # the job-wide diagnosis (runtime/diagnostics/flight_watch.py)
    _ranks: dict = field(default_factory=dict, repr=False)  # id(group) -> (group, its global ranks)

    def ranks_of(self, group) -> tuple[int, ...]:
        """The global ranks of ``group`` (cached: the flight record names every collective's group)."""
        hit = self._ranks.get(id(group))
        if hit is None or hit[0] is not group:
            hit = self._ranks[id(group)] = (group, tuple(group_ranks(group)))
        return hit[1]

    def diagnosed(self, error: RuntimeCommError) -> RuntimeCommError:
        """``error`` with the job-wide diagnosis's summary in its message, once the diagnosis ran (if any)."""
        if self.on_failure is None:
            return error
        summary = self.on_failure(f"{error.what} ({error.where})")
        if not summary:
            return error
        rest = error.fix or ""
        return type(error)(error.what, where=error.where, fix=f"the job-wide diagnosis says: {summary}. "
                                                               f"{rest[:1].upper()}{rest[1:]}")

    def error(self, op: str, *, group, purpose: str, exc: BaseException) -> RuntimeCommError:
        """RuntimeCommError for collective ``op`` over ``group`` that failed with ``exc``."""
        ranks = group_ranks(group)
        text = str(exc).strip()
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        if timed_out and _timed(group):
            what = f"the {op} ({purpose}) did not complete within {self.timeout_s:g} s"
        elif timed_out:  # NCCL: the group's own timeout (module doc)
            what = f"the {op} ({purpose}) did not complete within the process group's timeout"
        else:
            what = f"the {op} ({purpose}) failed"
        place = self.place()
        where = f"rank {self.rank}" + (f", {place}" if place else "") + f", collective {op} over ranks {ranks}"
        return RuntimeCommError(
            f"{what}: {type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}",
            where=where,
            fix=f"check that every rank of {ranks} is alive and reached the same step and action (a rank that "
                f"raised or skipped a collective leaves its peers waiting: its own error is the cause); "
                f"raise p2p_timeout_s if a peer is only slow; the group is unusable now, so restart and "
                f"resume from the last checkpoint")

    def _failed(self, op: str, *, group, purpose: str, exc: BaseException, entry: int | None) -> RuntimeCommError:
        """The error for a failed collective, its flight entry marked failed and the job diagnosed."""
        if entry is not None:
            self.flight.end(entry, failed=True)
        return self.diagnosed(self.error(op, group=group, purpose=purpose, exc=exc))

    def _begin(self, op: str, group, purpose: str) -> int | None:
        return None if self.flight is None else self.flight.collective(op, purpose, self.ranks_of(group))

    def record(self, op: str, purpose: str, ranks) -> int | None:
        """A flight entry for an exchange among ``ranks`` the caller waits on itself (``wait(entry=...)``)."""
        return None if self.flight is None else self.flight.collective(op, purpose, tuple(sorted(ranks)))

    def wait(self, work, *, op: str, group, purpose: str, entry: int | None = None) -> None:
        """Wait for ``work`` (an async collective's handle) until the deadline; ``entry``: its flight entry."""
        flight = self.flight if entry is not None else None
        if flight is not None:
            flight.waiting(entry)
            began = time.perf_counter()
        try:
            if _timed(group):
                work.wait(datetime.timedelta(seconds=self.timeout_s))
            else:
                work.wait()
        except AutoparError:
            raise
        except Exception as exc:  # noqa: BLE001 - a timeout (RuntimeError/DistBackendError) or a dead peer
            raise self._failed(op, group=group, purpose=purpose, exc=exc, entry=entry) from exc
        if flight is not None:
            waited = time.perf_counter() - began
            flight.comm_wait_s += waited
            if waited > flight.longest_wait[0]:
                flight.longest_wait = (waited, entry)
            flight.end(entry)

    def run(self, op: str, fn, /, *args, group, purpose: str, async_op: bool = False, **kwargs):
        """``fn(*args, group=group, async_op=True, **kwargs)`` (a ``torch.distributed`` collective), then
        wait with the deadline; with ``async_op=True`` the caller waits later, on the :class:`GuardedWork`."""
        entry = self._begin(op, group, purpose)
        try:
            work = fn(*args, group=group, async_op=True, **kwargs)
        except AutoparError:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer already gone, a closed connection
            raise self._failed(op, group=group, purpose=purpose, exc=exc, entry=entry) from exc
        guarded = GuardedWork(work, guard=self, op=op, group=group, purpose=purpose, entry=entry)
        if async_op:
            return guarded
        guarded.wait()
        return None

    def call(self, op: str, fn, /, *args, group, purpose: str, **kwargs):
        """An object collective (no async form): run it, translating its errors (the group's timeout)."""
        entry = self._begin(op, group, purpose)
        if entry is not None:
            self.flight.waiting(entry)
        try:
            out = fn(*args, group=group, **kwargs)
        except AutoparError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._failed(op, group=group, purpose=purpose, exc=exc, entry=entry) from exc
        if entry is not None:
            self.flight.end(entry)
        return out


class GuardedWork:
    """An async collective's handle whose ``wait`` keeps the guard's deadline and error (and flight entry)."""

    def __init__(self, work, *, guard: CommGuard, op: str, group, purpose: str, entry: int | None = None):
        self.work, self.guard, self.op, self.group, self.purpose = work, guard, op, group, purpose
        self.entry = entry

    def wait(self, timeout=None) -> bool:
        self.guard.wait(self.work, op=self.op, group=self.group, purpose=self.purpose, entry=self.entry)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
