"""The job-wide diagnosis on real faults: each case of tests/flight_runners.py injects one into a
2-rank gloo run (p2p_timeout_s 2 s), and the report every surviving rank writes must name the
culprit rank, its last action and the collective or peer the others wait on.

Two worlds (tests/flight_runners.py ``launch``): one runs a rank that stops sending mid-1F1B, a
straggler that finishes, a rank asleep past the deadline, and last a rank killed with SIGKILL; the
other a rank that skips one all-reduce (gloo aborts it where the next pairs' sizes differ). When a
rank dies the launcher SIGTERMs the survivor, as torchrun does.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest

import flight_runners as fr

pytestmark = pytest.mark.dist

WORLDS = (("stop_sending", "straggler", "sleeper", "killed"), ("skip_all_reduce",))  # a dying case ends its world


_LAUNCHED: dict = {}  # cases -> (root, exit codes): each world runs once per session


def _world(cases: tuple[str, ...]):
    if cases not in _LAUNCHED:
        _LAUNCHED[cases] = fr.launch(list(cases))
    return _LAUNCHED[cases]


@pytest.fixture(scope="module", autouse=True)
def _remove_the_worlds_files():
    yield
    for root, _ in _LAUNCHED.values():
        shutil.rmtree(root, ignore_errors=True)


def _run(case: str):
    """(root, exit codes) of the world that ran ``case``."""
    return _world(next(w for w in WORLDS if case in w))


def _culprit(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("culprit:"))


def test_a_rank_that_stops_sending_mid_1f1b_is_named_with_the_microbatch_it_did_not_send():
    root, _ = _run("stop_sending")
    text = fr.report(root, "stop_sending")
    assert "culprit: rank 0: it ran 0F2 (step 2) but never sent the activation of edge 0, microbatch 2 that " \
           "rank 1 waits for" in text
    assert re.search(r"its last action: 0B2 \(stage 0, microbatch 2\), step 2", text)
    assert re.search(r"rank 1 gave up waiting in receive of the activation of edge 0, microbatch 2 from rank 0 "
                     r"\(stage 0\) after \d+\.\d s, during 1F2, waiting on rank 0", text), text
    verdicts, makers = set(), set()
    for rank in (0, 1):  # each rank's own error carries the verdict: the same one report, made by one rank
        out = fr.result(root, "stop_sending", rank)
        assert "the job-wide diagnosis says: culprit rank 0: it ran 0F2" in out["error"], out["error"]
        verdicts.add(out["error"].split("the job-wide diagnosis says: ")[1].split(" (report:")[0])
        makers.add(out["reporter"])
    assert len(verdicts) == 1 and len(makers) == 1 and None not in makers, (verdicts, makers)


def test_a_straggler_that_finishes_is_named_with_its_figures_and_the_wait_it_caused():
    root, _ = _run("straggler")
    results = [fr.result(root, "straggler", r) for r in (0, 1)]
    for out in results:
        assert out["error"] == ""
        (found,) = out["stragglers"][fr.FAULT_STEP]  # the step with the 0.8 s sleep: rank 1 alone, seen by both
        assert found["rank"] == 1 and found["peers"] == (0,) and found["slowest_action"].startswith("0F")
        assert found["forward_s"] >= 0.8 and found["slowest_s"] >= 0.8
    (warning,) = [w for w in results[0]["warnings"] if w.startswith(f"straggler at step {fr.FAULT_STEP}")]
    assert re.search(r"rank 1 \(pipeline rank 0\) computed its actions in \d+\.\d{3} s \(forward \d+\.\d{3} s",
                     warning), warning
    node = fr.VICTIM
    assert re.search(rf"rank 0's longest wait this step: \d+\.\d{{3}} s in all_reduce #\d+ over ranks \[0, 1\] "
                     rf"\(TpReduce node {node} \(mesh axis tp\)\) during 0F0", warning), warning
    assert not any(w.startswith("straggler") for w in results[1]["warnings"])  # one rank says it


def test_a_rank_asleep_past_the_deadline_is_named_by_the_rank_that_waits_for_it():
    root, _ = _run("sleeper")
    first, late = fr.result(root, "sleeper", 0)["error"], fr.result(root, "sleeper", 1)["error"]
    node = fr.VICTIM
    # rank 0 gives up after 2 s while rank 1 still sleeps in 0F0
    assert re.search(r"culprit rank 1: it waits on no peer: it has been running 0F0 \(stage 0, microbatch 0\) "
                     r"for \d\.\d s; its last action: 0F0", first), first
    assert re.search(rf"rank 0 gave up waiting in all_reduce #\d+ over ranks \[0, 1\] \(TpReduce node {node} "
                     rf"\(mesh axis tp\)\) after \d+\.\d s, during 0F0, waiting on rank 1", first), first
    # rank 1 wakes, finds rank 0 gone from the group and fails in turn: its error carries the same one report,
    # which its heartbeat thread took from the store while it slept
    assert "the job-wide diagnosis says: culprit rank 1: it waits on no peer" in late, late
    assert late.split("the job-wide diagnosis says: ")[1].split(" (report:")[0] == \
        first.split("the job-wide diagnosis says: ")[1].split(" (report:")[0]
    assert "culprit: rank 1:" in fr.report(root, "sleeper")


def test_a_rank_that_skips_a_tensor_parallel_all_reduce_is_named_at_the_first_divergence():
    root, codes = _run("skip_all_reduce")
    assert codes[1] == -6  # gloo aborts the skipper where the pairs' sizes differ (SIGABRT)
    assert codes[0] == -15  # the survivor wrote the report, then obeyed the launcher's SIGTERM
    text = fr.report(root, "skip_all_reduce")
    node = fr.VICTIM
    assert re.search(rf"culprit: rank 1: it skipped all_reduce \(TpReduce node {node} \(mesh axis tp\)\), which "
                     rf"rank 0 issued as #(\d+) over ranks \[0, 1\] during 0F0", text), text
    assert re.search(r"its last action: 0F\d \(stage 0, microbatch \d\), step 2", text)
    assert re.search(r"rank 0 (waits|gave up waiting) in all_reduce #\d+ over ranks \[0, 1\] \(.*\).*, "
                     r"waiting on rank 1", text), text
    assert "rank 1 (dp 0, pp 0, tp 1; stage 0): gone" in text and "record read from its flight file" in text


def test_a_rank_killed_with_sigkill_is_named_gone_with_the_action_it_died_in():
    root, codes = _run("killed")
    assert codes[1] == -9 and codes[0] in (-15, 0)
    text = fr.report(root, "killed")
    assert re.search(r"culprit: rank 1: it is gone \(no heartbeat for \d+\.\d s\); its record was read from its "
                     r"flight file", _culprit(text)), text
    assert "its last action: 1F2 (stage 1, microbatch 2), step 2, begun" in text
    assert "not ended when its record stops" in text
    assert re.search(r"rank 0 (waits|gave up waiting) in receive of the (activation|gradient) of edge 0, "
                     r"microbatch \d from rank 1 \(stage 1\).*, waiting on rank 1", text), text


@pytest.mark.parametrize("case", ["stop_sending", "skip_all_reduce", "killed"])
def test_autopar_diagnose_prints_the_report_the_ranks_wrote(case, capsys):
    from autopar.cli import main
    root, _ = _run(case)
    assert main(["diagnose", os.path.join(root, case)]) == 0
    assert capsys.readouterr().out == fr.report(root, case)


@pytest.mark.timing  # wall-clock bounds: skipped by default (tests/conftest.py), run with -m timing
@pytest.mark.parametrize("case", ["stop_sending", "skip_all_reduce", "killed"])
def test_the_report_comes_within_the_deadline_and_a_few_seconds(case):
    """From the first wait that never ends to the report: at most p2p_timeout_s (2 s) and 5 s."""
    from autopar.runtime.diagnostics.diagnosis import read_run
    root, _ = _run(case)
    report = read_run(os.path.join(root, case))
    first = min(w.entry.start for w in report.waits)
    assert report.now - first <= fr.TIMEOUT_S + 5.0, (case, report.now - first)
