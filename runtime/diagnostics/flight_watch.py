"""The job-wide watch: heartbeats, and the diagnosis every surviving rank writes when the job stops.

Each rank's :class:`JobWatch` talks to the job's *rendezvous store*, never to its process groups
(a group with a missed collective is unusable; the store is a plain key-value server):
:func:`open_store` connects a client to torchrun's store (``MASTER_ADDR``/``MASTER_PORT``: the
agent's store under torchrun, or the one rank 0 serves for ``init_process_group``'s ``env://``),
else takes the default group's own store, else a FileStore in ``run_dir``. Keys live under a
prefix of the program's own, agreed at build time, so restarts and later programs never mix.

- **Heartbeats**: a daemon thread writes ``hb/<rank>`` (the time and what the rank is doing) every
  :data:`HEARTBEAT_S` seconds and reads the failure counter; nothing else touches the store while
  the job is healthy. The interpreter's exit stops it and waits for its store call to return.
- **After a failure** (a collective or a receive past ``p2p_timeout_s``, a peer that died, a wait
  the thread sees last longer than that, or SIGTERM from torchrun tearing the job down inside a
  step), the failing rank raises the failure counter and publishes its flight record; every other
  live rank's thread sees the counter within a heartbeat and publishes its own. The *first* failing
  rank collects what came within two heartbeats and a second, reads the flight files of the ranks
  that did not publish (a killed rank leaves its file in ``run_dir``), makes the one report
  (:mod:`autopar.runtime.diagnostics.diagnosis`) and puts its text on the store; every other rank, failing
  later or still live, takes that same report from there. Every rank logs it and writes
  ``run_dir/diagnosis.txt`` (the maker also ``diagnosis.json``, which ``autopar diagnose`` rebuilds
  the text from), and its summary joins each rank's RuntimeCommError. Store traffic after a failure
  is one record per rank and one read of each by one rank. A SIGTERM that comes while a rank takes
  part waits until the report is written (torchrun sends SIGKILL only 30 s later).
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import signal
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from autopar.ops.flight_record import FlightRecord, read_record
from autopar.runtime.diagnostics.diagnosis import Diagnosis, RankView, diagnose, views_to_json

__all__ = ["JobWatch", "Report", "open_store", "start_watch", "HEARTBEAT_S", "write_report"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # seconds between heartbeats
PUBLISHED_ENTRIES = 1024  # a rank's newest entries it puts on the store (its file keeps them all)
_STORE_TIMEOUT_S = 10.0  # one store operation at most


def open_store(*, run_dir: str | None, world: int):
    """The rendezvous store (module docstring) and how it was found, or (None, reason)."""
    env = os.environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        try:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S), wait_for_workers=False)
            return store, f"torchrun's store at {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        except Exception as exc:  # noqa: BLE001 - no server there: try the next
            log.debug("no rendezvous store at MASTER_ADDR:MASTER_PORT: %s", exc)
    try:
        return dist.distributed_c10d._get_default_store(), "the default process group's store"
    except Exception as exc:  # noqa: BLE001 - a group made without a store
        log.debug("the default process group has no store: %s", exc)
    if run_dir:
        os.makedirs(os.path.join(run_dir, "flight"), exist_ok=True)
        return dist.FileStore(os.path.join(run_dir, "flight", "store"), world), f"a FileStore in {run_dir}"
    return None, "no store reachable"


def _doing(record: FlightRecord) -> str:
    """What the rank is doing, in a few words (its heartbeat's payload)."""
    latest = record.latest(8)
    for e in reversed(latest):
        if e.state == "waiting":
            return f"waiting in {e.describe()} (step {e.step})"
    for e in reversed(latest):
        if e.kind == "action":
            return f"{'running' if e.is_open else 'after'} {e.describe()} (step {e.step})"
    if not latest:
        return "not in a step yet"
    last = latest[-1]
    return f"after its {last.name} note" if last.kind == "note" else f"{last.kind} {last.describe()}"


def _in_step(record: FlightRecord) -> bool:
    """Whether the rank is inside a step: an action running, a collective or a receive not ended."""
    return any(e.is_open and e.kind in ("action", "collective", "recv") for e in record.latest(8))


@dataclass(frozen=True)
class Report:
    """The job's one report: its text, its one-line summary, the rank that made it, and (on that rank) the
    :class:`~autopar.runtime.diagnostics.diagnosis.Diagnosis` it was made from."""

    text: str
    summary: str
    reporter: int
    diagnosis: Diagnosis | None = None


def write_report(run_dir: str, report: Report, *, rank: int) -> str:
    """Write ``diagnosis.txt`` (and, on the rank that made it, ``diagnosis.json``) into ``run_dir``, each
    atomically; the text's path."""
    os.makedirs(run_dir, exist_ok=True)
    files = [("diagnosis.txt", report.text + "\n")]
    if report.diagnosis is not None:
        files.insert(0, ("diagnosis.json", views_to_json(report.diagnosis)))
    for name, text in files:
        tmp = os.path.join(run_dir, f".{name}.{rank}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(run_dir, name))
    return os.path.join(run_dir, "diagnosis.txt")


class JobWatch:
    """This rank's heartbeats and its part in the job-wide diagnosis (module docstring)."""

    def __init__(self, *, record: FlightRecord, store, prefix: str, world: int, run_dir: str | None,
                 timeout_s: float, heartbeat_s: float = HEARTBEAT_S):
        self.record, self.store, self.prefix, self.world = record, store, prefix, world
        self.rank, self.run_dir, self.timeout_s, self.heartbeat_s = record.rank, run_dir, timeout_s, heartbeat_s
        self.report: Report | None = None
        self.report_path: str | None = None
        self._seen_failures = 0
        self._busy = threading.Lock()  # held while this rank diagnoses
        self._terminate = False  # SIGTERM came during the diagnosis: die once it is written
        self._stop = threading.Event()

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{what}" + ("" if rank is None else f"/{rank}")

    # -- the heartbeat thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the heartbeat thread (it ends with this watch) and take part in SIGTERM."""
        if self.store is not None:
            thread = threading.Thread(target=_beat_loop, args=(weakref.ref(self), self._stop, self.heartbeat_s),
                                      daemon=True, name=f"autopar-heartbeat-{self.rank}")
            thread.start()
            # (holds the event and the thread, not the watch; the thread ends with the watch as before)
            atexit.register(_end_beats, self._stop, thread)
        _join_sigterm(self)

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        """One heartbeat: say we live, publish the record if a rank failed since, catch an overlong wait."""
        self.store.set(self._key("hb", self.rank), json.dumps({"t": time.time(), "doing": _doing(self.record)}))
        if self._stop.is_set():  # (the process is exiting: no second store call; one that hangs on a store whose
            return               # host has gone takes up to _STORE_TIMEOUT_S, and exit waits for it: _end_beats)
        failures = int(self.store.add(self._key("failures"), 0))
        if failures > self._seen_failures:
            self._seen_failures = failures
            self.publish()
        if failures:
            self._take_shared()
        self._watchdog()

    def _watchdog(self) -> None:
        """A wait the rank's own deadline should have ended (an untimed one: NCCL, an object collective)."""
        if self.report is not None:
            return
        limit = self.timeout_s + 2 * self.heartbeat_s + 1.0
        for e in self.record.latest(16):
            if e.state == "waiting" and time.time() - e.start > limit:
                self.diagnose(f"rank {self.rank} has been blocked in {e.describe()} for {time.time() - e.start:.0f} "
                              f"s, longer than p2p_timeout_s ({self.timeout_s:g} s)")
                return

    def publish(self, failure: str = "") -> None:
        """Put this rank's flight record on the store."""
        snapshot = self.record.snapshot(last=PUBLISHED_ENTRIES)
        self.store.set(self._key("record", self.rank), json.dumps({"snapshot": snapshot, "failure": failure}))
        if int(self.store.add(self._key("published", self.rank), 1)) == 1:
            self.store.add(self._key("published"), 1)

    # -- the diagnosis --------------------------------------------------------------------------------
    def diagnose(self, reason: str) -> Report | None:
        """This rank's part after a failure (once per watch): publish its record; the first failing rank
        collects every record and makes the report, the others take it from the store; every one logs and
        writes it. Returns the report."""
        if not self._busy.acquire(timeout=4 * self.heartbeat_s + 2 * _STORE_TIMEOUT_S):
            return self.report
        try:
            if self.report is None:
                self.record.note("failure", reason, failed=True)
                self.report = self._report(reason)
                self._emit()
            return self.report
        finally:
            self._busy.release()
            if self._terminate:
                _die()

    def _report(self, reason: str) -> Report:
        views = {}
        if self.store is not None:
            try:
                first = int(self.store.add(self._key("failures"), 1)) == 1
                self.publish(reason)
                shared = None if first else self._await_report()
                if shared is not None:
                    return shared
                views = self._collect()
            except Exception as exc:  # noqa: BLE001 - the store is gone too: this rank's record and the files
                log.warning("rank %d: the rendezvous store did not answer (%s): the diagnosis uses this rank's "
                            "record and the flight files in run_dir only", self.rank, exc)
        made = diagnose(self._with_files(views, reason), world=self.world, now=time.time(), reporter=self.rank,
                        reason=f"rank {self.rank}: {reason}")
        report = Report(made.text(), made.summary(), self.rank, made)
        if self.store is not None:
            try:
                self.store.set(self._key("report"), json.dumps({"text": report.text, "summary": report.summary,
                                                                "reporter": report.reporter}))
            except Exception as exc:  # noqa: BLE001 - the others make their own
                log.debug("rank %d: could not share the report: %s", self.rank, exc)
        return report

    def _await_report(self) -> Report | None:
        """The first failing rank's report, once it has collected (None if it never comes: then our own)."""
        deadline = time.monotonic() + 2 * self.heartbeat_s + 1.0 + _STORE_TIMEOUT_S
        while time.monotonic() < deadline:
            shared = self._get(self._key("report"))
            if shared is not None:
                return Report(shared["text"], shared["summary"], shared["reporter"])
            time.sleep(0.1)
        return None

    def _take_shared(self) -> None:
        """The heartbeat thread, after a failure elsewhere: log and write the job's report once it is there."""
        if self.report is not None or not self._busy.acquire(blocking=False):
            return
        try:
            shared = self._get(self._key("report"))
            if shared is not None and self.report is None:
                self.report = Report(shared["text"], shared["summary"], shared["reporter"])
                self._emit()
        finally:
            self._busy.release()

    def _emit(self) -> None:
        """Log the report and write it into run_dir."""
        log.error("job-wide diagnosis (made by rank %d; rank %d logs it):\n%s", self.report.reporter, self.rank,
                  self.report.text)
        if self.run_dir:
            self.report_path = write_report(self.run_dir, self.report, rank=self.rank)

    def _with_files(self, views: dict, reason: str) -> dict:
        """``views`` with this rank's own record and the flight files of the ranks that published nothing."""
        views.setdefault(self.rank, RankView(self.rank, self.record.snapshot(), source="store", alive=True,
                                             failure=reason))
        for rank in range(self.world):
            view = views.get(rank)
            if view is not None and view.source != "none" or not self.run_dir:
                continue
            snapshot = read_record(self.run_dir, rank)
            if snapshot is not None:
                views[rank] = RankView(rank, snapshot, source="file", alive=view.alive if view else False,
                                       heartbeat_age=view.heartbeat_age if view else None,
                                       heartbeat_doing=view.heartbeat_doing if view else "")
        return views

    def _collect(self) -> dict:
        """Every rank's published record within two heartbeats and a second, and each rank's last heartbeat."""
        deadline = time.monotonic() + 2 * self.heartbeat_s + 1.0
        while int(self.store.add(self._key("published"), 0)) < self.world and time.monotonic() < deadline:
            time.sleep(0.05)
        now, views = time.time(), {}
        for rank in range(self.world):
            beat = self._get(self._key("hb", rank))
            age, doing = (now - beat["t"], beat["doing"]) if beat else (None, "")
            published = self._get(self._key("record", rank))
            if published is not None:
                views[rank] = RankView(rank, published["snapshot"], source="store", heartbeat_age=age,
                                       heartbeat_doing=doing, alive=True, failure=published["failure"])
            else:  # not published: gone if its heartbeat stopped, else alive but silent
                views[rank] = RankView(rank, None, heartbeat_age=age, heartbeat_doing=doing,
                                       alive=age is not None and age < 2 * self.heartbeat_s)
        return views

    def _get(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def on_failure(self, text: str) -> str:
        """The main thread's hook before it raises RuntimeCommError: diagnose; a line for the error ("" if
        the diagnosis could not be made: the error it was to explain is raised all the same)."""
        try:
            report = self.diagnose(text)
        except Exception:  # noqa: BLE001 - never hide the rank's own error behind the diagnosis's
            log.exception("rank %d: the job-wide diagnosis failed", self.rank)
            return ""
        if report is None:
            return ""
        return report.summary + (f" (report: {self.report_path})" if self.report_path else "")

    def on_sigterm(self) -> bool:
        """SIGTERM (torchrun tears the job down) inside a step: diagnose first. True if a diagnosis is under
        way (this rank dies once it is written)."""
        if self._busy.locked():
            self._terminate = True
            return True
        if self.report is None and _in_step(self.record):  # (an idle program, a finished one: nothing to say)
            self.on_failure(f"rank {self.rank} received SIGTERM (the launcher stops the job) while "
                            f"{_doing(self.record)}")
        return False


def _beat_loop(ref, stop: threading.Event, period: float) -> None:
    """The heartbeat thread: beats until its watch is gone or stopped, or the store fails three beats in a
    row (its server is gone: the job is over)."""
    failed = 0
    while failed < 3:  # the first beat at once, then one per period
        watch = ref()
        if watch is None:
            return
        try:
            watch.beat()
            failed = 0
        except Exception as exc:  # noqa: BLE001 - the store went away: try again, quietly
            failed += 1
            log.debug("rank %d: heartbeat failed: %s", watch.rank, exc)
        del watch
        if stop.wait(period):
            return


def _end_beats(stop: threading.Event, thread: threading.Thread) -> None:
    """At interpreter exit: stop the heartbeat thread and wait for its store call to return. A daemon thread
    still inside a store call (C++, the GIL released) when the interpreter finalizes is ended in a way C++
    does not allow, and the process aborts ("terminate called without an active exception"), after a run
    that otherwise succeeded."""
    stop.set()
    thread.join(timeout=2 * _STORE_TIMEOUT_S + 1.0)  # (a beat's two store calls, each bounded by the timeout)


def _die() -> None:
    """End the process as the SIGTERM that was held back would have."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)


def _join_sigterm(watch: JobWatch) -> None:
    """Diagnose on SIGTERM: chain onto autopar's handler, or install one where none is set (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if getattr(current, "autopar_watches", None) is not None:
        current.autopar_watches.append(weakref.ref(watch))
        return
    if current not in (signal.SIG_DFL, None):
        return  # the user's own handler stays

    def handler(signum, frame):
        deferred = False
        for ref in list(handler.autopar_watches):
            live = ref()
            if live is not None:
                deferred = live.on_sigterm() or deferred
        if not deferred:
            _die()

    handler.autopar_watches = [weakref.ref(watch)]
    signal.signal(signal.SIGTERM, handler)


def start_watch(record: FlightRecord, *, world: int, run_dir: str | None, timeout_s: float) -> JobWatch | None:
    """This rank's watch over the job (collective: agrees on the store prefix); None on a world of one."""
    if world < 2 or not dist.is_initialized():
        return None
    nonce = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(nonce, src=0)  # the prefix of this program's keys, the same on every rank
    store, how = open_store(run_dir=run_dir, world=world)
    log.debug("rank %d: flight record watch over %s", record.rank, how)
    watch = JobWatch(record=record, store=store, prefix=f"/autopar/flight/{nonce[0]}", world=world, run_dir=run_dir,
                     timeout_s=timeout_s)
    watch.start()
    return watch
