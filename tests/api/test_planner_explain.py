"""``autopar plan --explain``: where the estimated step goes and which part a measured step time points at.

The attribution is checked against estimates whose parts are known (one part scaled, the measurement made
from it by hand); the CLI's wiring on a tiny model, and its refusals, without GPUs or processes.
"""
from __future__ import annotations

import re

import pytest

from autopar.cli import main
from autopar.planner.cost_model import Candidate, Estimate
from autopar.planner.measured import PARTS, additive_parts, explain_step

PARTS_OF = {"compute": 30.0, "tp_comm": 2.0, "bubble": 4.0, "dp_comm": 0.5, "optimizer": 0.1}


def _estimate(parts=PARTS_OF):
    return Estimate(Candidate(8, 16, 8, 192, "1f1b"), step_time=sum(parts.values()),
                    parts={**parts, "p2p": 0.003, "ep_comm": 0.0})


def _named(lines) -> str:
    return re.match(r"most likely (.+?): ", lines[2]).group(1)


def test_the_parts_add_up_to_the_step_and_p2p_is_not_one_of_them():
    e = _estimate()
    assert sum(additive_parts(e).values()) == pytest.approx(e.step_time)
    assert "p2p" not in additive_parts(e) and "ep_comm" not in additive_parts(e)
    (line,) = explain_step(e)
    assert line.startswith(f"estimated {e.step_time:.4g} s/step for dp=8 pp=16 tp=8") and "compute 30 s (82%)" in line


# (parts, the part changed, its factor): each case's change is the smallest in its part's own spreads
# (compute 10%, tp and the bubble 50%, dp 100%; docs/planner.md), worked out by hand in the comment
CASES = [
    (PARTS_OF, "compute", 1.08),  # compute +8%: 0.77 spreads; the bubble would need +60%: 0.94
    (PARTS_OF, "compute", 0.85),  # -4.5 s: the bubble (4 s) cannot fall that far; compute -15%: 1.6 spreads
    ({"compute": 10.0, "bubble": 10.0, "tp_comm": 1.0}, "bubble", 2.0),  # 1.4 spreads; compute x2: 6.9
    ({"compute": 5.0, "tp_comm": 5.0, "bubble": 1.0}, "tp_comm", 2.0),  # 1.4; the bubble x6: 3.6
    ({"compute": 5.0, "dp_comm": 5.0}, "dp_comm", 3.0),  # 1.1; compute x3: 11
]


@pytest.mark.parametrize("parts, part, factor", CASES)
def test_the_part_that_was_changed_is_the_one_named(parts, part, factor):
    e = _estimate(parts)
    measured = e.step_time + parts[part] * (factor - 1)
    lines = explain_step(e, measured=measured)
    assert lines[1].startswith(f"measured {measured:.4g} s/step")
    assert _named(lines) == PARTS[part]
    share = re.search(r"(\d+)% (more|less) would explain it", lines[2])
    assert int(share.group(1)) == round(abs(factor - 1) * 100)
    assert share.group(2) == ("more" if factor > 1 else "less")


def test_a_difference_no_part_explains_says_so():
    lines = explain_step(_estimate(), measured=400.0)
    assert lines[-1].startswith("no single part explains a difference this large")


def test_cli_explains_a_pinned_mesh_beside_the_measured_time(capsys):
    argv = ["plan", "autopar.models.examples:gpt_tiny", "--world", "4", "--cluster", "cpu-2core",
            "--mesh", "dp=1,pp=2,tp=2", "--explain", "--measured-step-s", "0.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    est = next(i for i, line in enumerate(out) if line.startswith("estimated "))
    assert "dp=1 pp=2 tp=2" in out[est]
    assert out[est + 1].startswith("measured 0.5 s/step: the estimate is")
    assert out[est + 2].startswith("most likely ")


@pytest.mark.parametrize("argv, message", [
    (["plan", "autopar.models.examples:gpt_tiny", "--measured-step-s", "1.0"],
     "--measured-step-s is read by --explain"),
    (["plan", "--published", "no-such-run", "--explain"], "no published run 'no-such-run'"),
    (["plan", "autopar.models.examples:gpt_tiny", "--published", "mtnlg-530b-2240"], "pass no TARGET"),
    (["plan"], "needs a TARGET"),
])
def test_cli_refuses_what_it_cannot_explain(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
