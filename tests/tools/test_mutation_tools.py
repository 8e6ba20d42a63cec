"""The mutation tools themselves (tests/tools/mutation.py, tests/tools/fork_pytest.py), without a mutation run:
every module the score covers has tests that exist, the operator filter keeps what its docstring says, and the
test server's finder reads autopar from this checkout."""
from __future__ import annotations

import importlib.util
import re
import shlex
import sqlite3
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mutation = _load("mutation")
fork_pytest = _load("fork_pytest")

#: the modules issue 30 names: a small bug in them gives a wrong number
NAMED = ["runtime/execution/item_count.py", "runtime/execution/weight_versions.py", "passes/tp/tp_rules.py",
         "runtime/state/zero.py", "runtime/state/grad_sync.py"] + [
    f"runtime/schedules/{p.name}" for p in sorted((ROOT / "runtime/schedules").glob("*.py")) if p.name != "__init__.py"]


def test_every_named_module_has_a_test_selection():
    assert sorted(set(NAMED) - set(mutation.MODULES)) == []
    assert sorted(set(mutation.MODULES) - set(NAMED)) == []


@pytest.mark.parametrize("module", sorted(mutation.MODULES))
def test_each_selection_names_files_that_exist(module):
    assert (ROOT / module).is_file(), module
    paths = [a.split("::")[0] for a in shlex.split(mutation.MODULES[module]) if a.startswith("tests/")]
    assert paths, f"{module}: no test file in {mutation.MODULES[module]!r}"
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"{module}: {missing}"


def _excluded(operator: str) -> bool:
    return any(re.search(pattern, operator) for pattern in mutation.EXCLUDE_OPERATORS)


@pytest.mark.parametrize("operator,dropped", [
    ("core/ReplaceBinaryOperator_Add_Sub", False), ("core/ReplaceBinaryOperator_Mul_Div", False),
    ("core/ReplaceBinaryOperator_Div_FloorDiv", False), ("core/ReplaceBinaryOperator_Add_Mul", True),
    ("core/ReplaceBinaryOperator_Add_Sub_x", True), ("core/ReplaceComparisonOperator_Lt_LtE", False),
    ("core/ReplaceComparisonOperator_Eq_NotEq", False), ("core/ReplaceComparisonOperator_Lt_Gt", True),
    ("core/ReplaceUnaryOperator_Delete_Not", False), ("core/ReplaceUnaryOperator_USub_Invert", True),
    ("core/NumberReplacer", False), ("core/ReplaceOrWithAnd", False), ("core/ZeroIterationForLoop", False),
])
def test_the_operator_filter_keeps_the_meaning_flips_and_every_other_operator(operator, dropped):
    assert _excluded(operator) is dropped


def test_the_server_finds_autopar_in_this_checkout():
    finder = fork_pytest.CheckoutFinder(ROOT)
    spec = finder.find_spec("autopar.runtime")
    assert Path(spec.origin) == ROOT / "runtime" / "__init__.py"
    assert finder.find_spec("autopar") is not None
    assert finder.find_spec("torch") is None


def test_a_session_kept_from_another_clone_is_pointed_at_this_checkouts_module(tmp_path):
    """``--again``/``--resume`` from a clone other than the session's: cosmic-ray would write the mutants into the
    other clone's module (the path it stored) and run this checkout's tests on its unmutated one."""
    session = tmp_path / "s.sqlite"
    db = sqlite3.connect(session)
    db.execute("create table mutation_specs (module_path varchar, job_id varchar)")
    db.executemany("insert into mutation_specs values (?, ?)", [("/tmp/other/passes/tp/tp_rules.py", "a"),
                                                                ("/tmp/other/passes/tp/tp_rules.py", "b")])
    db.commit()
    db.close()
    here = ROOT / "passes/tp/tp_rules.py"
    assert mutation._take_session(session, here) == 2
    assert mutation._take_session(session, here) == 0
    rows = sqlite3.connect(session).execute("select distinct module_path from mutation_specs").fetchall()
    assert rows == [(str(here),)]
