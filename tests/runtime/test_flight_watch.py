"""The job-wide watch in one process: two ranks' watches on one in-memory store (torch's HashStore),
heartbeats every 0.2 s: a live rank's thread publishes its record after a peer's failure, a rank
without heartbeats is gone, and a wait longer than the deadline is diagnosed by the thread itself."""
from __future__ import annotations

import time

import torch.distributed as dist

from autopar.runtime.flight_record import ACTION, FlightRecord
from autopar.runtime.flight_watch import JobWatch

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
    finally:
        busy.stop()
    assert report.views[1].source == "store" and report.views[1].alive  # its heartbeat thread published it
    assert report.culprit.rank == 1 and report.culprit.why.startswith("it waits on no peer: it has been running 0F0")
    assert waiter.diagnose("again") is report  # one diagnosis per watch
    assert (tmp_path / "diagnosis.txt").read_text() == report.text() + "\n"
    assert "job-wide diagnosis says" not in waiter.on_failure("later")  # the hook returns the summary line
    assert waiter.on_failure("later").startswith("culprit rank 1: it waits on no peer")


def test_a_rank_without_heartbeats_is_gone():
    store = dist.HashStore()
    waiter = _watch(0, store)
    _wait_in_all_reduce(waiter)
    report = waiter.diagnose("a test's failure")  # it waits two beats and a second for rank 1 to publish
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
    assert stuck.report is not None and "longer than p2p_timeout_s (0.1 s)" in stuck.report.reason
    assert stuck.report.culprit.rank == 1
