"""The harness's judge of every rank (tests/equivalence.py judge_ranks), on outcomes made by hand: a rank
whose losses, gathered full state or dp replica differ from the others' is reported, in a nested result too."""
from __future__ import annotations

import torch

from equivalence import judge_ranks


def _rank(dp: int, *, loss=1.0, weight=0.5, full=0.5) -> dict:
    return {"losses": [loss], "state": {"w": torch.tensor([full])}, "coords": {"dp": dp, "pp": 0, "tp": 0},
            "replica": {"stage0.w": torch.tensor([weight])}}


def test_agreeing_ranks_pass():
    assert "error" not in judge_ranks([_rank(0), _rank(1)])


def test_a_second_replica_with_other_weights_is_reported():
    result = judge_ranks([_rank(0), _rank(1, weight=0.25)])
    assert "rank 1 (dp=1, pp=0, tp=0): parameter stage0.w differs from its dp replica" in result["error"]


def test_a_rank_with_another_full_state_is_reported():
    result = judge_ranks([_rank(0), _rank(1, full=0.75)])
    assert result["error"] == "rank 1's full state differs from rank 0's at w"


def test_a_rank_with_other_losses_is_reported_also_inside_a_nested_result():
    assert "rank 1 reports losses [2.0]" in judge_ranks([_rank(0), _rank(1, loss=2.0)])["error"]
    first, second = _rank(0), _rank(1)
    first["reference"], second["reference"] = {"losses": [1.0]}, {"losses": [3.0]}
    assert judge_ranks([first, second])["error"].startswith("reference: rank 1 reports losses [3.0]")
