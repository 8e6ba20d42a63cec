"""The schedule registry is the one table of families: nothing else lists them, and its facts hold.

The facts are checked against what they describe: the defaults against compile/plan and
build_schedule, split backward and asynchrony against the built Schedule (the closed forms against
the simulator: tests/runtime/test_schedule_closed_forms.py).
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss
from autopar.runtime.schedules.registry import (
    ASYNC_SCHEDULES,
    build_schedule,
    default_stages_per_rank,
    family,
    planner_schedules,
    schedule_names,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("autopar", "ir", "ops", "passes", "runtime", "models")  # the product (bench/ picks peers to race: not a registry)
REGISTRY = ROOT / "runtime" / "schedules" / "registry.py"
# StalenessRule's own kinds ("pipedream", "2bw", "pipemare"): a vocabulary of weight-version rules, not families
#: lists naming families that are not the registry's table: the schedules staleness rules cover, and the ones
#: the published runs the planner is fitted to used (Megatron's; data about those runs, not a list of families)
NOT_FAMILY_LISTS = {"runtime/schedules/staleness.py": [["pipedream", "pipemare"]],
                    "autopar/planner/published.py": [["1f1b", "interleaved_1f1b"]]}


def _family_lists(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """(line, names) of every tuple, list, set or dict literal naming two or more families (``__all__`` aside)."""
    names = set(schedule_names())
    tree = ast.parse(path.read_text(encoding="utf-8"))
    exports = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}
    found = []
    for node in ast.walk(tree):
        if id(node) in exports or not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            continue
        items = node.keys if isinstance(node, ast.Dict) else node.elts
        listed = [e.value for e in items if isinstance(e, ast.Constant) and e.value in names]
        if len(listed) >= 2:
            found.append((node.lineno, listed))
    return found


def test_no_module_outside_the_registry_lists_schedule_families():
    offenders = {str(p.relative_to(ROOT)): [names for _, names in lists] for folder in SOURCES for p in sorted((ROOT / folder).rglob("*.py"))
                 if p != REGISTRY and (lists := _family_lists(p))}
    assert offenders == NOT_FAMILY_LISTS
    assert _family_lists(REGISTRY), "the scan finds the registry's own table"


@pytest.mark.parametrize("name", schedule_names())
def test_each_family_builds_what_its_row_says(name):
    row = family(name)
    schedule = build_schedule(name, num_ranks=2, num_microbatches=4)
    assert schedule.num_stages == 2 * row.stages_per_rank * row.replicas
    assert schedule.split_backward == row.split_backward
    assert (schedule.staleness is not None) == row.asynchronous == (name in ASYNC_SCHEDULES)
    assert default_stages_per_rank(name) == row.stages_per_rank and default_stages_per_rank(name, 3) == 3


def test_the_planner_searches_the_registry_families_in_their_order():
    assert planner_schedules() == (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("gpipe", 1), ("zb_v", 2))
    from autopar.planner.auto import search_space
    assert search_space({"schedule": "looped_bfs"}, {}).schedules == (("looped_bfs", 2),)
    assert search_space({"schedule": "dualpipev"}, {}).schedules == (("dualpipev", 2),)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    x = torch.randint(0, 128, (8, 8))
    return build_model("gpt_tiny", num_layers=4), x


# 1f1b, and every family whose stages per rank or replicas differ from one (each plan costs a capture)
DEFAULTS = [n for n in schedule_names(asynchronous=False)
            if n == "1f1b" or family(n).stages_per_rank > 1 or family(n).replicas > 1]


@pytest.mark.parametrize("name", DEFAULTS)
def test_plan_uses_the_registry_default_and_builds_the_schedule_once(name, tiny, monkeypatch):
    import autopar.validation as validation  # check_plan builds the Plan's schedule
    model, x = tiny
    built = []
    real = validation.build_schedule
    monkeypatch.setattr(validation, "build_schedule", lambda *a, **k: built.append(a) or real(*a, **k))
    result = autopar.plan(model, {"pp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=x, schedule=name,
                          num_microbatches=4, capture="symbolic_trace", ranks=[0])
    assert len(built) == 1
    assert result.plan.pipeline.num_virtual == family(name).stages_per_rank
    expected = build_schedule(name, num_ranks=2, num_microbatches=4)
    assert result.schedule.stage_to_rank == expected.stage_to_rank
    assert result.schedule.actions == expected.actions


def _in_flight_peak(schedule) -> int:
    """The most microbatches any rank holds between a forward and its backward, counted from the actions alone."""
    peak = 0
    for actions in schedule.actions:
        held = 0
        for action in actions:
            held += {"F": 1, "B": -1}.get(action.kind.value, 0)
            peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name", schedule_names(asynchronous=False))
def test_peak_grows_is_what_the_orders_do(name):
    """Family.peak_grows (the planner scales a short schedule's peak by m when it is set,
    autopar/planner/schedule_shapes.py): the in-flight peak at 8 and at 16 microbatches on 2 ranks, counted here."""
    peaks = [_in_flight_peak(build_schedule(name, num_ranks=2, num_microbatches=m)) for m in (8, 16)]
    assert (peaks[1] > peaks[0]) == family(name).peak_grows, peaks


@pytest.mark.parametrize("virtual", [2.5, "2", True])
def test_num_virtual_must_be_a_whole_number(virtual):
    with pytest.raises(autopar.ScheduleError, match="needs num_virtual >= 2 stages per rank"):
        build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=4, num_virtual=virtual)


def test_the_fix_names_the_other_families_for_the_stage_count():
    """interleaved_1f1b (at least 2 stages per rank) points to 1f1b for one, looped_bfs (at least 1) nowhere; zb_v
    (exactly 2) to the zero-bubble
    families of one stage per rank; 1f1b (exactly 1) to the interleaved ones."""
    with pytest.raises(autopar.ScheduleError) as few:
        build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=4, num_virtual=1)
    assert "or use '1f1b' for one stage per rank" in few.value.fix
    with pytest.raises(autopar.ScheduleError) as none:  # (looped_bfs takes one stage per rank too: no such hint)
        build_schedule("looped_bfs", num_ranks=2, num_microbatches=4, num_virtual=0)
    assert "needs num_virtual >= 1" in none.value.what and "1f1b" not in none.value.fix
    with pytest.raises(autopar.ScheduleError) as v_shape:
        build_schedule("zb_v", num_ranks=2, num_microbatches=4, num_virtual=3)
    assert "zb_h1 or zb_h2 for one stage per rank" in v_shape.value.fix
    with pytest.raises(autopar.ScheduleError) as one:
        build_schedule("1f1b", num_ranks=2, num_microbatches=4, num_virtual=2)
    assert "interleaved_1f1b or looped_bfs" in one.value.fix and "zb_h1" not in one.value.fix
