"""The job-wide watch in one process: two ranks' watches on one in-memory store (torch's HashStore),
heartbeats every 0.2 s: a live rank's thread publishes its record after a peer's failure, a rank
without heartbeats is gone, and a wait longer than the deadline is diagnosed by the thread itself."""
from __future__ import annotations

import time

import torch.distributed as dist

from autopar.ops.flight_record import ACTION, FlightRecord
from autopar.runtime.diagnostics.flight_watch import JobWatch

BEAT = 0.2


def _watch(rank: int, store, *, run_dir=None, timeout_s: float = 60.0) -> JobWatch:
    record = FlightRecord(rank=rank, capacity=32, meta={"world": 2})
    record.step = 1
    return JobWatch(record=record, store=store, prefix="/t", world=2, run_dir=run_dir, timeout_s=timeout_s,
                    heartbeat_s=BEAT)


def _wait_in_all_reduce(watch: JobWatch) -> None:
    watch.record.begin(ACTION, "0F0", stage=0, microbatch=0)
    watch.record.waiting(watch.record.collective("all_reduce", "TpReduce node tp_reduce_0", (0, 1)))


def test_a_live_peer_publishes_its_record_and_is_named_running(tmp_path):
    store = dist.HashStore()
    waiter, busy = _watch(0, store, run_dir=str(tmp_path)), _watch(1, store)
    busy.record.begin(ACTION, "0F0", stage=0, microbatch=0)  # rank 1 computes, never reaching the all-reduce
    _wait_in_all_reduce(waiter)
    busy.start()
    try:
        report = waiter.diagnose("a test's failure")
        deadline = time.monotonic() + 10  # rank 1's thread takes the same report from the store
        while busy.report is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        busy.stop()
    made = report.diagnosis  # rank 0 failed first: it made the report
    assert report.reporter == 0 and made.views[1].source == "store" and made.views[1].alive  # rank 1's thread
    assert made.culprit.rank == 1 and made.culprit.why.startswith("it waits on no peer: it has been running 0F0")
    assert waiter.diagnose("again") is report  # one diagnosis per watch
    assert (tmp_path / "diagnosis.txt").read_text() == report.text + "\n"
    assert waiter.on_failure("later").startswith("culprit rank 1: it waits on no peer")  # the error's line
    assert busy.report is not None and busy.report.text == report.text and busy.report.reporter == 0


def test_a_rank_without_heartbeats_is_gone():
    store = dist.HashStore()
    waiter = _watch(0, store)
    _wait_in_all_reduce(waiter)
    report = waiter.diagnose("a test's failure").diagnosis  # it waits two beats and a second for rank 1 ...
    assert report.views[1].alive is False and report.culprit.rank == 1  # ... which never beat
    assert report.culprit.why == "it is gone (no heartbeat)"


def test_the_heartbeat_thread_diagnoses_a_wait_past_the_deadline_by_itself():
    """An untimed wait (NCCL, an object collective) past p2p_timeout_s: nobody raises, the thread reports."""
    store = dist.HashStore()
    stuck, peer = _watch(0, store, timeout_s=0.1), _watch(1, store)
    _wait_in_all_reduce(stuck)
    peer.record.begin(ACTION, "0F0", stage=0, microbatch=0)
    for w in (stuck, peer):
        w.start()
    try:
        deadline = time.monotonic() + 15
        while stuck.report is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for w in (stuck, peer):
            w.stop()
    assert stuck.report is not None and "longer than p2p_timeout_s (0.1 s)" in stuck.report.diagnosis.reason
    assert stuck.report.diagnosis.culprit.rank == 1


_EXIT_WHILE_BEATING = """
import datetime, socket, sys, time
import torch.distributed as dist
from autopar.ops.flight_record import FlightRecord
from autopar.runtime.diagnostics.flight_watch import JobWatch

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                       wait_for_workers=False)
watch = JobWatch(record=FlightRecord(rank=0, capacity=8, meta={"world": 2}), store=client, prefix="/t", world=2,
                 run_dir=None, timeout_s=60.0, heartbeat_s=0.0)  # beats back to back: always in a store call
watch.start()
time.sleep(0.3)
print("exiting", flush=True)
"""


def test_a_process_that_exits_while_its_heartbeat_thread_is_in_a_store_call_exits_cleanly():
    """The interpreter's exit stops the heartbeat thread and waits for its store call (an atexit hook).
    Before, a daemon thread inside the store's C++ call at finalization aborted the process after a run
    that had succeeded ("terminate called without an active exception", seen in the tutorial's 4-rank run)."""
    import subprocess
    import sys
    for attempt in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BEATING], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and "exiting" in done.stdout, (attempt, done.returncode, done.stderr[-2000:])
