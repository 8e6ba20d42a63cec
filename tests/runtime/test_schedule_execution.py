"""Every synchronous schedule trains like one device; wrong combinations fail before anything runs.

The spawned cases live in tests/schedule_runners.py (one group of 2 ranks and one of 4 runs them all,
with the asynchronous and trace cases); the error cases go through ``autopar.plan`` in this process.
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.errors import PlanError, ScheduleError
from autopar.models import build_model, lm_loss
from case_marks import by_world
from equivalence import Case, assert_equivalent, assert_outputs_match, reference_run
from schedule_runners import INFER_CASES, SYNC_CASES, results


@functools.lru_cache(maxsize=None)
def _reference(model: str, overrides: tuple) -> dict:
    return reference_run(Case(model=model, overrides=overrides))


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(SYNC_CASES, ids=lambda c: c.name()))
def test_schedule_matches_single_device(case: Case):
    assert_equivalent(case, results(case.world_size)[case], _reference(case.model, case.overrides))


@pytest.mark.dist
@pytest.mark.parametrize("case", by_world(INFER_CASES, ids=lambda c: c.name()))
def test_forward_only_schedule_matches_single_device(case: Case):
    assert_outputs_match(case, results(case.world_size)[case])  # every rank's outputs


def _plan(schedule: str, *, pp: int = 2, m: int = 4, layers: int = 2, model: str = "gpt_tiny", **options):
    x = torch.zeros(8, 16, dtype=torch.long)
    return autopar.plan(build_model(model, num_layers=layers, seq_len=16), {"pp": pp}, example_inputs=(x,),
                        loss_fn=lm_loss, example_target=x, schedule=schedule, num_microbatches=m, **options)


@pytest.mark.parametrize(("schedule", "options", "error", "message", "fix"), [
    ("1f1b", dict(pp=4, m=2), ScheduleError, "1f1b needs num_microbatches >= 4", "use the 'gpipe' schedule"),
    ("interleaved_1f1b", dict(pp=4, m=2, num_virtual=2), ScheduleError, "multiple of num_ranks",
     "num_microbatches=4"),
    ("zb_v", dict(num_virtual=3), ScheduleError, "exactly 2 stage", "drop num_virtual"),
    ("interleaved_1f1b", dict(num_virtual=1), ScheduleError, "needs num_virtual >= 2", "use '1f1b'"),
    ("pipedream_2bw", dict(pp=4, m=2), ScheduleError, "pipedream_2bw needs num_microbatches >= 4", "'pipedream'"),
])
def test_wrong_schedule_combinations_fail_before_capture(schedule, options, error, message, fix, monkeypatch):
    import autopar.passes.frontend.capture_model as capture_model  # the capture pass's tracer
    monkeypatch.setattr(capture_model, "capture", lambda *a, **k: pytest.fail("captured before checking"))
    with pytest.raises(error, match=message) as info:
        _plan(schedule, **options)
    assert fix in str(info.value)


def test_fewer_blocks_than_stages_names_the_stage_count():
    # 1 block: a stage may begin at it or right after it, so 3 stages at most; pp=2 x 2 per rank is 4
    with pytest.raises(PlanError, match="at most 3 pipeline stages") as info:
        _plan("interleaved_1f1b", layers=1, num_virtual=2)
    assert "num_virtual" in info.value.fix and "more blocks" in info.value.fix


def test_async_schedule_refuses_weights_tied_across_ranks():
    from autopar.runtime.execution.async_pipeline import AsyncProgram
    result = _plan("pipedream", m=2)  # GPT ties its embedding and head: stages 0 and 1
    assert result.plan.shared_params["lm_head.weight"] == (0, 1)
    with pytest.raises(PlanError, match="no weight shared by stages on different ranks") as info:
        AsyncProgram.check_tied(result.plan, stage_to_rank=result.schedule.stage_to_rank, name="pipedream")
    assert "pipedream_2bw" in info.value.fix


def test_plan_of_chimera_holds_two_replicas():
    result = _plan("chimera", m=2)
    assert result.schedule.num_replicas == 2 and result.schedule.stage_to_rank == (0, 1, 1, 0)
    assert [s.stage for s in result.ranks[0].stages] == [0, 3] and [s.stage for s in result.ranks[1].stages] == [1, 2]
    down_last, up_last = result.ranks[1].stages[0], result.ranks[0].stages[1]  # part 1 of each replica
    assert down_last.gm.code == up_last.gm.code  # the same program...
    recv = lambda stage: next(m for m in stage.gm.modules() if hasattr(m, "edge"))  # noqa: E731
    assert (recv(down_last).src_stage, recv(up_last).src_stage) == (0, 2)  # ...its p2p re-addressed
    assert result.plan.shared_params["blocks.0.ln_1.weight"] == (0, 2)  # both replicas' gradients summed
