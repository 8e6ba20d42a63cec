"""passes/, runtime/, ir/, ops/ and their sub-packages map their files in ``__init__.py``: the maps stay whole.

Each package docstring lists every module of its folder as ``name.py`` and every sub-package as
``name/`` (``runtime/schedules/``, ``passes/tp/``); a new file or sub-package without a line, or a line
naming one that is gone, fails here.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def listed(docstring: str) -> list[str]:
    """The ``name.py`` files and ``name/`` sub-packages a package map lists, in its order."""
    return re.findall(r"^[ \t]*([a-z0-9_]+(?:\.py|/))[ \t]", docstring, flags=re.MULTILINE)


def map_problems(folder: pathlib.Path) -> list[str]:
    """What the folder's ``__init__`` map lacks or names in vain."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    files = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    files |= {p.parent.name + "/" for p in folder.glob("*/__init__.py")}
    names = listed(doc)
    problems = [f"{folder.name}/{f} is not in {folder.name}/__init__.py's map" for f in sorted(files - set(names))]
    problems += [f"{folder.name}/__init__.py maps {f}, which does not exist" for f in names if f not in files]
    problems += [f"{folder.name}/__init__.py maps {f} twice" for f in sorted({n for n in names if names.count(n) > 1})]
    return problems


@pytest.mark.parametrize(("folder", "least"), [
    ("passes", 8), ("runtime", 5), ("ir", 6), ("ops", 10), ("passes/frontend", 15), ("passes/tp", 16),
    ("passes/moe", 5), ("passes/pipeline", 5), ("passes/data_parallel", 1), ("passes/context_parallel", 7),
    ("runtime/execution", 19), ("runtime/state", 13), ("runtime/checkpoints", 5), ("runtime/diagnostics", 4)])
def test_package_docstring_maps_every_file(folder, least):
    assert map_problems(ROOT / folder) == []
    assert len(listed(ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())))) >= least


def test_a_missing_or_stale_entry_is_reported(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A map::\n\n    a.py   first\n    gone.py   removed\n"""\n')
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    problems = map_problems(tmp_path)
    assert any("b.py is not in" in p for p in problems) and any("maps gone.py" in p for p in problems)
    assert any("sub/ is not in" in p for p in problems)
    assert len(problems) == 3
