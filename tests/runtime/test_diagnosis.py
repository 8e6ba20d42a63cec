"""The job-wide diagnosis read off hand-written flight records (no processes): each rule that finds a
culprit, the report's round trip through diagnosis.json, and ``autopar diagnose``. The same rules
on real faults: tests/runtime/test_flight_faults.py."""
from __future__ import annotations

import pytest

from autopar.cli import main
from autopar.ops import flight_record
from autopar.ops.flight_record import ACTION, DONE, RECV, SEND, STEP, WAITING, FlightRecord
from autopar.runtime.diagnostics.diagnosis import RankView, diagnose, read_run
from autopar.runtime.diagnostics.flight_watch import Report, write_report


class Clock:
    """Stands in for the ``time`` module the record reads its times from."""

    def __init__(self):
        self.t = 1000.0

    def time(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(flight_record, "time", c)
    return c


def _record(rank: int, **kwargs) -> FlightRecord:
    record = FlightRecord(rank=rank, capacity=64, meta={"coords": {"dp": 0, "pp": 0, "tp": rank}, "stages": [0]},
                          **kwargs)
    record.step = 3
    record.end(record.begin(STEP, "step"))
    return record


def _tp(record: FlightRecord, nodes, *, wait_last=True, ranks=(0, 1), clock=None):
    """All-reduces of TpReduce ``nodes`` inside one open action 0F1, the last one waited in."""
    record.begin(ACTION, "0F1", stage=0, microbatch=1)
    for i, node in enumerate(nodes):
        entry = record.collective("all_reduce", f"TpReduce node {node}", ranks)
        if clock is not None:
            clock.t += 0.01
        if i == len(nodes) - 1 and wait_last:
            record.waiting(entry)
        else:
            record.end(entry)


def _views(*records, extra=()):
    views = {r.rank: RankView(r.rank, r.snapshot(), source="store", alive=True, heartbeat_age=0.5)
             for r in records}
    views.update({v.rank: v for v in extra})
    return views


def _report(views, world=2, now=1010.0):
    return diagnose(views, world=world, now=now, reporter=0, reason="rank 0: a test")


def test_a_rank_that_skipped_a_collective_is_the_culprit_at_the_first_divergence(clock):
    nodes = [f"tp_reduce_{i}" for i in range(6)]
    r0, r1 = _record(0), _record(1)
    _tp(r0, nodes)
    _tp(r1, nodes[:2] + nodes[3:], wait_last=False)
    r1.collective("all_reduce", "the loss", (0, 1))  # rank 1 moved on, one short
    d = _report(_views(r0, r1))
    assert d.culprit.rank == 1
    assert d.culprit.why.startswith("it skipped all_reduce (TpReduce node tp_reduce_2), which rank 0 issued as #3 "
                                    "over ranks [0, 1] during 0F1")
    assert (d.divergence.seq, d.divergence.culprits) == (3, {1: "skipped"})
    (wait,) = d.waits
    assert (wait.rank, wait.on, wait.entry.seq) == (0, (1,), 6)  # rank 1's #6 is another collective
    assert "first divergence: collective #3 over ranks [0, 1]" in d.text()


def test_with_three_ranks_the_majority_tells_which_one_issued_another_collective():
    records = [_record(r) for r in range(3)]
    for r, record in enumerate(records):
        _tp(record, ["a", "x" if r == 2 else "b", "c"], ranks=(0, 1, 2), wait_last=False)
    d = _report(_views(*records), world=3)
    assert d.divergence.culprits == {2: "issued another collective"} and d.culprit.rank == 2
    assert "as #2 over ranks [0, 1, 2] it issued all_reduce (TpReduce node x)" in d.culprit.why


def test_a_rank_with_no_heartbeat_and_no_record_is_gone(clock):
    r0 = _record(0)
    r0.begin(ACTION, "0B2", stage=0, microbatch=2)
    r0.begin(RECV, "gradient", stage=0, microbatch=2, peer=1, peer_stage=1, seq=0, state=WAITING)
    gone = RankView(1, None, heartbeat_age=4.2, heartbeat_doing="running 1F2 (stage 1, microbatch 2) (step 3)",
                    alive=False)
    d = _report(_views(r0, extra=[gone]))
    assert d.culprit.rank == 1 and d.culprit.why == "it is gone (no heartbeat for 4.2 s)"
    assert "its last action: unknown (its last heartbeat said: running 1F2" in d.text()
    assert d.waits[0].on == (1,)


def test_the_rank_the_waits_lead_to_that_runs_an_action_is_the_culprit(clock):
    r0, r1 = _record(0), _record(1)
    _tp(r0, ["a", "b"])
    _tp(r1, ["a"], wait_last=False)  # rank 1 is still computing 0F1 (sleeping, throttled)
    clock.t += 3.0
    d = _report(_views(r0, r1), now=clock.t)
    assert d.culprit.rank == 1
    assert d.culprit.why == "it waits on no peer: it has been running 0F1 (stage 0, microbatch 1) for 3.0 s"
    assert d.waits[0].on == (1,) and "rank 0 waits in all_reduce #2 over ranks [0, 1] (TpReduce node b)" in d.text()


@pytest.mark.parametrize("sent", [False, True])
def test_in_a_cycle_of_receives_the_rank_that_ran_the_producer_without_sending_is_the_culprit(sent):
    r0, r1 = _record(0), _record(1)
    r0.end(r0.begin(ACTION, "0F2", stage=0, microbatch=2))
    if sent:
        r0.begin(SEND, "activation", microbatch=2, peer=1, peer_stage=1, seq=0, state=DONE)
    r0.begin(ACTION, "0B2", stage=0, microbatch=2)
    r0.begin(RECV, "gradient", stage=0, microbatch=2, peer=1, peer_stage=1, seq=0, state=WAITING)
    r1.begin(ACTION, "1F2", stage=1, microbatch=2)
    r1.begin(RECV, "activation", stage=1, microbatch=2, peer=0, peer_stage=0, seq=0, state=WAITING)
    d = _report(_views(r0, r1))
    if sent:  # it was sent and never arrived: nobody to blame from the records
        assert d.culprit is None and "culprit: none found" in d.text()
    else:
        assert d.culprit.rank == 0
        assert d.culprit.why == ("it ran 0F2 (step 3) but never sent the activation of edge 0, microbatch 2 that "
                                 "rank 1 waits for")


def test_a_rank_that_came_after_its_peer_gave_up_is_the_culprit(clock):
    r0, r1 = _record(0), _record(1)
    _tp(r0, ["a", "b"])  # rank 0 waits in #2 ...
    _tp(r1, ["a"], wait_last=False)
    clock.t += 2.0
    r0.end(r0.num_written - 1, failed=True)  # ... and gives up after 2 s
    clock.t += 2.0
    r1.waiting(r1.collective("all_reduce", "TpReduce node b", (0, 1)))  # rank 1 arrives 4 s after rank 0
    d = _report(_views(r0, r1), now=clock.t)
    assert d.culprit.rank == 1 and d.culprit.why.startswith(
        "it issued all_reduce #2 over ranks [0, 1] (TpReduce node b) 4.0 s after rank 0 had begun waiting in it "
        "(rank 0 gave up after 2.0 s); it was running 0F1 until then")
    assert d.waits[0].on == (1,)  # it came too late for rank 0


def test_every_rank_in_the_same_collective_names_no_culprit():
    r0, r1 = _record(0), _record(1)
    _tp(r0, ["a", "b"])
    _tp(r1, ["a", "b"])
    d = _report(_views(r0, r1))
    assert d.culprit is None and all(w.on == () for w in d.waits)
    assert "every other rank of it has issued it too" in d.text()


def test_the_report_reads_back_the_same_from_the_run_dir_and_from_flight_files_alone(tmp_path, capsys):
    run = tmp_path / "run"
    r0, r1 = _record(0, folder=str(run)), _record(1, folder=str(run))
    nodes = ["a", "b", "c", "d"]
    _tp(r0, nodes)
    _tp(r1, nodes[:1] + nodes[2:], wait_last=False)
    d = _report(_views(r0, r1))
    write_report(str(run), Report(d.text(), d.summary(), 0, d), rank=0)
    assert main(["diagnose", str(run)]) == 0
    assert capsys.readouterr().out == d.text() + "\n" == (run / "diagnosis.txt").read_text()
    (run / "diagnosis.json").unlink()  # no rank lived to write one: the flight files alone
    offline = read_run(str(run))
    assert offline.reporter == -1 and offline.culprit.rank == 1 and "skipped" in offline.culprit.why
    assert "rebuilt from the flight files" in offline.text()


def test_autopar_diagnose_on_a_folder_without_records_is_an_input_error(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "holds no diagnosis.json and no flight files" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
