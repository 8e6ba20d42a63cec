"""Mutation score of the modules where a small bug gives a wrong number, against the single-process tests
that cover them (cosmic-ray, the ``mutation`` extra of pyproject.toml).

    python tests/tools/mutation.py                          # every module below, one after another
    python tests/tools/mutation.py runtime/execution/item_count.py    # one module
    python tests/tools/mutation.py passes/tp/tp_rules.py --lines 374-470   # only mutants on those lines

For each module: ``cosmic-ray init`` (every mutant of the module), the operator filter below, an optional
line filter, then ``nice -n 19 cosmic-ray exec``: each mutant is written into the module in place, the
module's tests run, and the mutant is *killed* when the tests fail (or time out). The tests run through
tests/tools/fork_pytest.py: one server (under ``nice -n 19`` too) imports torch once and forks a fresh
child per mutant, which imports autopar from this checkout; the tests are first run once unmutated and must
pass. Run it from a clone of the repository (``git clone -b BRANCH . /tmp/mut``, then
``python /tmp/mut/tests/tools/mutation.py ...``) to keep working in the checkout meanwhile. The survivors
are printed with their line and the mutated code; docs/testing.md records the score and explains each
survivor no test kills. The module is checked back to its committed text afterwards (``git diff``), and
restored with ``git checkout`` if a run was cut short. Runs are CPU heavy: one module at a time.

Operators: cosmic-ray's, less the replacements that only multiply the count of one site without another
question to ask of the tests (of the 11 replacements of each binary operator, the one that flips its meaning:
``+`` and ``-``, ``*`` and ``/``, ``//`` and ``/``, ``%`` and ``//``, ``**`` and ``*``, ``|`` and ``&``; of
the comparisons, the boundary and the negation: ``<`` and ``<=``, ``==`` and ``!=``, ``in`` and ``not in``,
``is`` and ``is not``); every other operator (numbers, ``not`` added or removed, ``and``/``or``, ``True``/
``False``, a loop run zero times, a decorator removed, ``break``/``continue``) is kept whole.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORK_PYTEST = ROOT / "tests" / "tools" / "fork_pytest.py"
PYTEST_ARGS = "-x -q -p no:cacheprovider --no-header"

#: module -> the single-process tests that cover it (a tight selection: each mutant is judged in seconds)
_RT = "tests/runtime/"
_GEN = f"{_RT}test_schedule_generators.py {_RT}test_schedule_torch_orders.py"
_FORMS = f"{_RT}test_schedule_closed_forms.py::test_the_closed_forms_equal_the_simulator_on_a_grid"
MODULES = {
    "runtime/execution/item_count.py": f"{_RT}test_item_count.py",
    "runtime/execution/weight_versions.py": f"{_RT}test_weight_versions.py",
    "runtime/schedules/staleness.py": f"{_RT}test_async_pipeline.py -m 'not dist'",
    "runtime/schedules/interleaved.py": _GEN,
    "runtime/schedules/one_f_one_b.py": _GEN,
    "runtime/schedules/gpipe.py": _GEN,
    "runtime/schedules/naive.py": _GEN,
    "runtime/schedules/_common.py": f"{_GEN} {_RT}test_schedule_validator.py",
    "runtime/schedules/zero_bubble.py": f"{_GEN} {_RT}test_schedule_simulator.py",
    "runtime/schedules/zb_v.py": f"{_GEN} {_RT}test_schedule_simulator.py {_FORMS}[zb_v]",
    "runtime/schedules/dualpipe.py": f"{_GEN} {_FORMS}[dualpipe] {_FORMS}[dualpipev]",
    "runtime/schedules/chimera.py": f"{_RT}test_schedule_chimera.py {_GEN} {_FORMS}[chimera]",
    "runtime/schedules/list_scheduler.py": f"{_RT}test_schedule_chimera.py {_FORMS}[chimera]",
    "runtime/schedules/forward_only.py": f"{_RT}test_schedule_chimera.py {_RT}test_schedule_action.py",
    "runtime/schedules/asynchronous.py": f"{_RT}test_async_pipeline.py -m 'not dist' {_RT}test_schedule_generators.py",
    "runtime/schedules/action.py": f"{_RT}test_schedule_action.py {_RT}test_schedule_validator.py",
    "runtime/schedules/deps.py": f"{_RT}test_schedule_validator.py {_RT}test_schedule_simulator.py "
                                 "tests/test_docstring_examples.py::test_docstring_examples_run"
                                 "[autopar.runtime.schedules.deps]",
    "runtime/schedules/validator.py": f"{_RT}test_schedule_validator.py",
    "runtime/schedules/simulator.py": f"{_RT}test_schedule_simulator.py {_RT}test_step_graph.py "
                                      f"{_RT}test_async_pipeline.py::test_simulated_weight_versions -m 'not dist'",
    "runtime/schedules/step_graph.py": f"{_RT}test_step_graph.py {_RT}test_schedule_validator.py -m 'not dist'",
    "runtime/schedules/shared_cores.py": f"{_RT}test_schedule_shared_cores.py",
    "runtime/schedules/closed_form.py": f"{_RT}test_schedule_closed_forms.py",
    "runtime/schedules/registry.py": f"{_GEN} {_RT}test_schedule_closed_forms.py {_RT}test_schedule_registry.py "
                                     "tests/api/test_planner_bound.py "
                                     "-k 'not test_plan_uses and not test_no_module_outside'",
    "passes/tp/tp_rules.py": "tests/passes/test_tp_rules_units.py tests/passes/test_tp_rules_layouts.py "
                             "tests/passes/test_tp_rules_ops.py tests/passes/test_tp_refusals.py "
                             "tests/passes/test_tp_train_numerics.py",
    "runtime/state/zero.py": f"{_RT}test_zero_units.py {_RT}test_zero_optimizer_units.py {_RT}test_program_optimizer.py "
                             f"{_RT}test_precision_clip.py -m 'not dist'",
    "runtime/state/grad_sync.py": f"{_RT}test_grad_sync_units.py",
}

_KEEP_BINARY = ("Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Div", "Div_FloorDiv", "Mod_FloorDiv",
                "Pow_Mul", "BitOr_BitAnd", "BitAnd_BitOr")
_KEEP_COMPARISON = ("Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Eq_NotEq", "NotEq_Eq", "In_NotIn", "NotIn_In",
                    "Is_IsNot", "IsNot_Is")
EXCLUDE_OPERATORS = [
    rf"core/ReplaceBinaryOperator_(?!({'|'.join(_KEEP_BINARY)})$)",
    rf"core/ReplaceComparisonOperator_(?!({'|'.join(_KEEP_COMPARISON)})$)",
    r"core/ReplaceUnaryOperator_(?!(USub_UAdd|Delete_USub|Delete_Not)$)",
]


def _config(module: str, tests: str, lines: str | None, timeout: float, server: Path) -> str:
    lines_section = ""
    if lines:
        lines_section = f'\n[cosmic-ray.filters.line-filter.lines]\n"{ROOT / module}" = ["{lines}"]\n'
    command = f"{sys.executable} {FORK_PYTEST} --socket {server} --timeout {timeout} -- {PYTEST_ARGS} {tests}"
    command = command.replace('"', '\\"')
    return f'''[cosmic-ray]
module-path = "{ROOT / module}"
timeout = {timeout + 60}
excluded-modules = []
test-command = "{command}"

[cosmic-ray.distributor]
name = "local"

[cosmic-ray.filters.operators-filter]
exclude-operators = {json.dumps(EXCLUDE_OPERATORS)}
{lines_section}'''


def _tool(name: str, *args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / name), *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def _survivors(session: Path) -> tuple[int, int, list[tuple]]:
    """(mutants run, killed, [(line, operator, occurrence, the mutated line)] of the survivors)."""
    db = sqlite3.connect(session)
    rows = db.execute("""select s.start_pos_row, s.operator_name, s.occurrence, r.worker_outcome, r.test_outcome,
                         r.diff from mutation_specs s join work_results r on s.job_id = r.job_id""").fetchall()
    ran = [r for r in rows if str(r[3]).upper() != "SKIPPED"]
    alive = sorted((r[0], r[1].removeprefix("core/"), r[2], _added_line(r[5])) for r in ran
                   if str(r[4]).upper() == "SURVIVED")
    return len(ran), len(ran) - len(alive), alive


def _added_line(diff: str | None) -> str:
    added = [line[1:].strip() for line in (diff or "").splitlines() if line.startswith("+") and
             not line.startswith("+++")]
    return " / ".join(added)


def _judge_survivors_again(session: Path) -> int:
    """Forget the survivors' outcomes, so that ``cosmic-ray exec`` runs them again (after new tests)."""
    db = sqlite3.connect(session)
    with db:
        count = db.execute("delete from work_results where upper(test_outcome) = 'SURVIVED'").rowcount
    db.close()
    return count


def _take_session(session: Path, module_path: Path) -> int:
    """Point a kept session's mutants at ``module_path`` (this checkout's module): cosmic-ray writes each
    mutant to the path stored in the session, which is another clone's when the session was made there."""
    db = sqlite3.connect(session)
    with db:
        count = db.execute("update mutation_specs set module_path = ? where module_path != ?",
                           (str(module_path), str(module_path))).rowcount
    db.close()
    return count


@contextlib.contextmanager
def _test_server(folder: Path, name: str):
    """A fork_pytest server for the run (its socket), stopped afterwards."""
    sock = folder / f"{name}.sock"
    sock.unlink(missing_ok=True)
    server = subprocess.Popen(["nice", "-n", "19", sys.executable, str(FORK_PYTEST), "--serve", str(sock)], cwd=ROOT)
    try:
        while not sock.exists():
            if server.poll() is not None:
                raise RuntimeError(f"the test server stopped (exit {server.returncode}) before serving")
            time.sleep(0.5)
        yield sock
    finally:
        server.terminate()
        server.wait()


def _baseline(sock: Path, tests: str, timeout: float) -> None:
    """The tests pass on the committed module, or there is nothing to measure."""
    code = subprocess.run([sys.executable, str(FORK_PYTEST), "--socket", str(sock), "--timeout", str(timeout), "--",
                           *shlex.split(f"{PYTEST_ARGS} {tests}")], cwd=ROOT).returncode
    if code != 0:
        log = sock.with_suffix(".log").read_text()
        raise RuntimeError(f"the tests fail without any mutant (exit {code}): {tests}\n{log[-3000:]}")


def run(module: str, *, tests: str | None = None, lines: str | None = None, timeout: float = 300.0,
        keep: Path | None = None, resume: bool = False, again: bool = False) -> dict:
    """Mutate ``module`` against its tests (``MODULES``' unless given); the score and the survivors."""
    folder = Path(keep or tempfile.mkdtemp(prefix="autopar-mutation-"))
    folder.mkdir(parents=True, exist_ok=True)
    name = module.replace("/", "_").removesuffix(".py")
    config, session = folder / f"{name}.toml", folder / f"{name}.sqlite"
    tests = tests or MODULES[module]
    with _test_server(folder, name) as sock:
        config.write_text(_config(module, tests, lines, timeout, sock))
        if (again or resume) and session.exists() and _take_session(session, ROOT / module):
            print(f"{module}: the session was made in another checkout; its mutants now go to {ROOT / module}",
                  file=sys.stderr)
        if again:
            print(f"{module}: judging {_judge_survivors_again(session)} survivors again", file=sys.stderr)
        elif not (resume and session.exists()):
            session.unlink(missing_ok=True)
            _tool("cosmic-ray", "init", str(config), str(session))
            _tool("cr-filter-operators", str(session), str(config))
            if lines:
                _tool("cr-filter-lines", "--config", str(config), str(session))
        _baseline(sock, tests, timeout)
        try:
            subprocess.run(["nice", "-n", "19", str(Path(sys.executable).parent / "cosmic-ray"), "exec", str(config),
                            str(session)], check=True, cwd=ROOT)
        finally:
            if subprocess.run(["git", "diff", "--quiet", "--", module], cwd=ROOT).returncode != 0:
                subprocess.run(["git", "checkout", "--", module], cwd=ROOT, check=True)
                print(f"{module}: restored to its committed text after an interrupted run", file=sys.stderr)
    ran, killed, alive = _survivors(session)
    source = (ROOT / module).read_text().splitlines()
    return {"module": module, "tests": tests, "lines": lines, "mutants": ran, "killed": killed,
            "score": killed / ran if ran else None,
            "survivors": [{"line": line, "operator": op, "occurrence": occ, "code": source[line - 1].strip(),
                           "mutant": mutant} for line, op, occ, mutant in alive]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES), help="modules to mutate (default: all)")
    parser.add_argument("--lines", help="only mutants on these lines of the one module given, e.g. 374-470")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's tests")
    parser.add_argument("--keep", type=Path, help="keep the sessions (cr-report, cr-html read them) in this folder")
    parser.add_argument("--resume", action="store_true", help="go on with the session kept in --keep, if any")
    parser.add_argument("--again", action="store_true",
                        help="judge the survivors of the session kept in --keep again (after new tests)")
    parser.add_argument("--tests", help="pytest arguments to judge the one module given by, instead of MODULES'")
    args = parser.parse_args(argv)
    if (args.again or args.resume) and not args.keep:
        parser.error("--again and --resume need --keep (the folder of the sessions)")
    if (args.lines or args.tests) and len(args.modules) != 1:
        parser.error("--lines and --tests need exactly one module")
    for module in args.modules:
        if module not in MODULES and not args.tests:
            parser.error(f"{module} has no test command here; known: {', '.join(MODULES)}")
        if subprocess.run(["git", "diff", "--quiet", "--", module], cwd=ROOT).returncode != 0:
            parser.error(f"{module} has uncommitted changes: cosmic-ray writes mutants into it in place")
    for module in args.modules:
        result = run(module, tests=args.tests, lines=args.lines, timeout=args.timeout, keep=args.keep,
                     resume=args.resume, again=args.again)
        score = "n/a" if result["score"] is None else f"{result['score']:.1%}"
        print(f"{module}{' lines ' + args.lines if args.lines else ''}: {result['killed']} of {result['mutants']} "
              f"mutants killed ({score})")
        for s in result["survivors"]:
            print(f"  survived: line {s['line']} {s['operator']} #{s['occurrence']}: {s['code']}  ->  {s['mutant']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
