"""Every module whose source holds a ``>>>`` example runs its docstring examples here.

The modules are found by reading the source folders, not listed by hand, so a new module's examples
run without anyone adding it; each test asserts that examples were attempted (a module whose
``>>>`` lies outside any docstring would otherwise pass having run nothing) and that none failed.
"""
from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# source folder -> the import name it is installed under (pyproject's [tool.setuptools.package-dir])
PACKAGES = {"autopar": "autopar", "ir": "autopar.ir", "ops": "autopar.ops", "passes": "autopar.passes",
            "runtime": "autopar.runtime", "models": "autopar.models"}


def module_name(path: pathlib.Path) -> str:
    """``runtime/schedules/gpipe.py`` -> ``autopar.runtime.schedules.gpipe`` (a package's ``__init__``: itself)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = (PACKAGES[parts[0]],) + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_with_examples() -> list[str]:
    found = [module_name(p) for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))
             if ">>>" in p.read_text(encoding="utf-8")]
    return sorted(found)


MODULES = modules_with_examples()


def test_examples_were_found():
    """The scan itself works: the folders hold dozens of modules with examples."""
    assert len(MODULES) >= 40, MODULES
    assert "autopar.runtime.schedules.gpipe" in MODULES and "autopar.models" in MODULES
    assert {"autopar.ir.shard_layout", "autopar.ops.comm_guard", "autopar.ops.context_parallel.ring"} <= set(MODULES)


def test_every_source_folder_is_scanned():
    """The folders scanned are pyproject's top-level source folders, every one (a new layer's examples run too)."""
    import tomllib
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    assert {folder: name for name, folder in dirs.items() if "/" not in folder} == PACKAGES


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module: str):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module} has '>>>' in its source but no docstring example ran"
    assert result.failed == 0, f"{module}: {result.failed} of {result.attempted} examples failed"
