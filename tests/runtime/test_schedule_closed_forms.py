"""Every family's closed forms (runtime/schedules/registry.py) against the simulator on a grid of p, m, v.

With every stage's F, B and W costing 1 (a backward that is not split: 2) and free transfers, the
simulator's step time, mean bubble and per-rank peak of (stage, microbatch) activations must equal
the formulas wherever the registry says they are exact, and the stage placement must be the
generator's. docs/schedules.md prints the formulas; the page must hold what the registry generates.
"""
from __future__ import annotations

import pathlib
import re

import pytest

import autopar
from autopar.runtime.schedules import StageCosts, simulate
from autopar.runtime.schedules.closed_form import parse
from autopar.runtime.schedules.registry import build_schedule, closed_forms_table, family, schedule_names

ROOT = pathlib.Path(__file__).resolve().parents[2]
UNIT = StageCosts(forward=1, backward=1, weight=1)


def _virtuals(name: str) -> tuple[int, ...]:
    row = family(name)
    return (row.stages_per_rank,) if row.fixed else (2, 3)


def _grid(name: str):
    """(p, m, v) of the grid that the family's generator builds."""
    form = family(name).closed_form
    for v in _virtuals(name):
        for p in (2, 3, 4, 5, 6, 8):
            for m in sorted({*range(1, 2 * p + 3), 3 * p, 4 * p, 4 * p + 1}):
                try:
                    form.peaks(p, m, v)  # the generator's own condition (ScheduleError outside it)
                except autopar.ScheduleError:
                    continue
                yield p, m, v


@pytest.mark.parametrize("name", schedule_names())
def test_the_closed_forms_equal_the_simulator_on_a_grid(name):
    form = family(name).closed_form
    checked = 0
    for p, m, v in _grid(name):
        schedule = build_schedule(name, num_ranks=p, num_microbatches=m, num_virtual=v)
        sim = simulate(schedule, costs=UNIT)
        where = f"{name} p={p} m={m} v={v}"
        assert form.placement(p, v) == schedule.stage_to_rank, where
        if form.peak_holds_at(p, m, v):
            assert form.peaks(p, m, v) == sim.peak_activations, where
        if form.step_holds_at(p, m, v):
            assert form.step_time(p, m, v) == pytest.approx(sim.step_time, abs=1e-9), where
            assert form.bubble(p, m, v) == pytest.approx(sim.mean_bubble, abs=1e-12), where
            checked += 1
    assert checked >= 12, f"{name}: only {checked} points of the grid are covered by its formulas"


@pytest.mark.parametrize("name", ["chimera", "dualpipe"])
@pytest.mark.parametrize("p", [10, 12])
def test_the_two_replica_forms_hold_on_deeper_pipelines(name, p):
    """Chimera's greedy order and DualPipe's halves, read off smaller pipelines, still hold at p = 10 and 12."""
    form = family(name).closed_form
    for m in (p // 2 + 1, 2 * p, 2 * p + 2, 3 * p + 1):
        sim = simulate(build_schedule(name, num_ranks=p, num_microbatches=m), costs=UNIT)
        assert form.peaks(p, m, 1) == sim.peak_activations, (p, m)
        if form.step_holds_at(p, m, 1):
            assert form.bubble(p, m, 1) == pytest.approx(sim.mean_bubble, abs=1e-12), (p, m)


def test_the_published_bubbles_are_what_the_registry_writes():
    """The papers' figures, typed here from the papers, not from the registry."""
    assert str(family("1f1b").closed_form.bubble_expr) == "(p - 1)/(m + p - 1)"
    assert str(family("gpipe").closed_form.bubble_expr) == "(p - 1)/(m + p - 1)"
    assert str(family("interleaved_1f1b").closed_form.bubble_expr) == "(p - 1)/(m*v + p - 1)"
    zb_h1 = family("zb_h1").closed_form  # Qi et al.: (p - 1) of 3 m + p - 1 units once m >= p
    assert zb_h1.bubble(8, 16, 1) == pytest.approx(7 / (3 * 16 + 7))


def test_the_closed_forms_refuse_what_the_generators_refuse():
    with pytest.raises(autopar.ScheduleError, match="1f1b needs num_microbatches >= 4"):
        family("1f1b").closed_form.peaks(4, 2, 1)
    with pytest.raises(autopar.ScheduleError, match="multiple of 4"):
        family("interleaved_1f1b").closed_form.peaks(4, 6, 2)


def test_docs_schedules_prints_the_registry_formulas():
    page = (ROOT / "docs" / "schedules.md").read_text()
    block = re.search(r"<!-- closed-forms -->\n(.*?)\n<!-- /closed-forms -->", page, flags=re.S)
    assert block, "docs/schedules.md has no <!-- closed-forms --> block"
    assert block.group(1) == closed_forms_table(), \
        "docs/schedules.md is out of date: run python bench/make_schedule_pictures.py --closed-forms"


def test_the_symbols_are_positive_integers_and_the_rank_may_be_zero():
    """p, m, v count (>= 1) and r numbers a rank (>= 0): sympy simplifies the printed formulas under those facts."""
    for name in ("p", "m", "v"):
        assert parse(name).is_integer and parse(name).is_positive, name
    rank = parse("r")
    assert rank.is_integer and rank.is_nonnegative and rank.is_positive is None
    assert parse("floor(m*v)") == parse("m*v") and parse("Mod(2*m, 2)") == 0
