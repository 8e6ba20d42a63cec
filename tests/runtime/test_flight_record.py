"""The flight record on its own: the ring buffer, group sequence numbers, the file a killed process
leaves, and the straggler verdict from the step's figures (no processes but one fork)."""
from __future__ import annotations

import os
import signal

import pytest

from autopar.ops.flight_record import ACTION, DONE, RECV, SEND, WAITING, FlightRecord, read_record
from autopar.runtime.diagnostics.diagnosis import RankView
from autopar.runtime.diagnostics.stragglers import MIN_EXCESS_S, RATIO, find_stragglers


def test_the_ring_keeps_the_last_entries_in_order_and_forgets_the_oldest():
    record = FlightRecord(rank=0, capacity=4)
    indices = [record.begin(ACTION, f"0F{i}", stage=0, microbatch=i) for i in range(10)]
    assert [e.name for e in record.entries()] == ["0F6", "0F7", "0F8", "0F9"]
    assert [e.index for e in record.entries()] == [6, 7, 8, 9]
    record.end(indices[2])  # its slot holds entry 6 now: nothing changes
    assert [e.state for e in record.entries()] == ["open"] * 4
    record.end(indices[7])
    record.end(indices[9], failed=True)
    assert [e.state for e in record.entries()] == ["open", "done", "open", "failed"]
    assert [e.name for e in record.latest(2)] == ["0F8", "0F9"]
    assert record.num_written == 10


def test_collectives_are_numbered_per_group_of_ranks():
    record = FlightRecord(rank=1, capacity=16)
    for op, ranks in [("all_reduce", (0, 1)), ("all_reduce", (1, 3)), ("all_gather", (0, 1)), ("reduce", (0, 1))]:
        record.collective(op, "p", ranks)
    got = [(e.name, e.group, e.seq) for e in record.entries()]
    assert got == [("all_reduce", (0, 1), 1), ("all_reduce", (1, 3), 1), ("all_gather", (0, 1), 2),
                   ("reduce", (0, 1), 3)]


def test_transfers_and_their_states_read_back_in_words():
    record = FlightRecord(rank=1, capacity=8)
    record.begin(SEND, "gradient", microbatch=2, peer=0, peer_stage=0, seq=1, state=DONE)
    wait = record.begin(RECV, "activation", stage=1, microbatch=3, peer=0, peer_stage=0, seq=1, state=WAITING)
    send, recv = record.entries()
    assert send.describe() == "send of the gradient of edge 1, microbatch 2 to rank 0 (stage 0)"
    assert recv.describe() == "receive of the activation of edge 1, microbatch 3 from rank 0 (stage 0)"
    assert (send.state, recv.state) == ("done", "waiting")
    record.end(wait)
    assert record.entries()[1].state == "done" and record.entries()[1].end >= recv.start


def test_a_killed_process_leaves_its_record_in_the_run_dir(tmp_path):
    """The record is a file mapped into memory: what the process wrote is there after SIGKILL."""
    pid = os.fork()
    if pid == 0:  # the child: record, then die without any chance to flush
        record = FlightRecord(rank=3, capacity=8, folder=str(tmp_path), meta={"world": 4})
        record.step = 2
        record.end(record.begin(ACTION, "1F0", stage=1, microbatch=0))
        record.collective("all_reduce", "the loss", (2, 3))
        record.begin(ACTION, "1F1", stage=1, microbatch=1)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    snapshot = read_record(str(tmp_path), 3)
    assert snapshot["meta"]["world"] == 4 and snapshot["meta"]["rank"] == 3
    entries = RankView(3, snapshot).entries
    assert [(e.name, e.state, e.step) for e in entries] == [("1F0", "done", 2), ("all_reduce", "open", 2),
                                                             ("1F1", "open", 2)]
    assert read_record(str(tmp_path), 0) is None


def _row(pp, forward, backward=0.0, blocked=0.0, slowest=0, slowest_s=0.0):
    return [pp, forward, backward, blocked, slowest, slowest_s]


def test_a_rank_much_slower_than_its_peers_on_the_same_stages_is_a_straggler():
    rows = [_row(0, 0.10, 0.1, blocked=0.9), _row(0, 1.0, 0.1, slowest=1, slowest_s=0.9), _row(1, 0.1, 0.1),
            _row(1, 0.11, 0.1)]
    (found,) = find_stragglers(rows, action_names=[["0F0", "0F1"], ["1F0", "1F1"]], step=5)
    assert (found.rank, found.pp, found.peers, found.slowest_action, found.step) == (1, 0, (0,), "0F1", 5)
    assert found.compute_s == pytest.approx(1.1) and found.peer_compute_s == pytest.approx(0.2)
    assert found.peer_blocked_s == pytest.approx(0.9)
    assert "rank 1 (pipeline rank 0) computed its actions in 1.100 s" in found.message()


@pytest.mark.parametrize("peer, slow", [(1.0, 1.0 * RATIO - 0.05),  # over by 0.45 s but under the ratio
                                        (0.05, 0.05 + MIN_EXCESS_S - 0.01)])  # 2.8 times, by under 0.1 s
def test_a_rank_not_markedly_slower_is_no_straggler(peer, slow):
    """Below the ratio, or above it by less than MIN_EXCESS_S: no straggler; just above both, one."""
    rows = [_row(0, peer), _row(0, slow)]
    assert find_stragglers(rows, action_names=[["0F0"]], step=1) == []
    rows = [_row(0, peer), _row(0, max(peer * RATIO, peer + MIN_EXCESS_S) + 0.01)]
    assert [s.rank for s in find_stragglers(rows, action_names=[["0F0"]], step=1)] == [1]


def test_ranks_on_different_stages_are_never_compared():
    rows = [_row(0, 0.1), _row(1, 5.0)]  # pp=2, no dp or tp: nobody runs the same stages
    assert find_stragglers(rows, action_names=[["0F0"], ["1F0"]], step=1) == []
