"""docs/api.md covers the public API, its options table is generated from CompileOptions, and
docs/index.md maps every page; every relative link between the docs resolves."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import autopar
import autopar.hf
import autopar.memory
import autopar.models
import autopar.report
from autopar.cli import build_parser
from autopar.options import CompileOptions
from autopar.planning import PlanResult
from autopar.report.api_doc import BEGIN, END, describe_option, options_table
from autopar.runtime.execution.program import RankProgram

DOCS = Path(__file__).resolve().parents[2] / "docs"
API = (DOCS / "api.md").read_text()


def _public(cls) -> list[str]:
    names = [n for n in vars(cls) if not n.startswith("_")]
    if dataclasses.is_dataclass(cls):
        names += [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    return sorted(set(names))


def test_every_option_has_a_meaning():
    missing = [name for name in CompileOptions.model_fields if not describe_option(name)]
    assert not missing, (f"CompileOptions fields without a description: {missing}; give them "
                         "Field(description=...) or an entry in autopar/report/api_doc.py OPTION_HELP")


def test_options_table_is_the_generated_one():
    table = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), API, flags=re.S)
    assert table, "docs/api.md lost its options markers"
    assert table.group(1) == options_table(), "run: python -m autopar.report.api_doc"


@pytest.mark.parametrize("module", [autopar, autopar.report, autopar.memory, autopar.models, autopar.hf],
                         ids=lambda m: m.__name__)
def test_every_public_name_is_documented(module):
    missing = [name for name in module.__all__ if not re.search(rf"\b{re.escape(name)}\b", API)]
    assert not missing, f"docs/api.md does not mention {module.__name__}.{missing}"


@pytest.mark.parametrize("cls,prefix", [(RankProgram, "program"), (PlanResult, "result")],
                         ids=["RankProgram", "PlanResult"])
def test_every_member_is_documented(cls, prefix):
    members = _public(cls) + (["plan", "schedule", "events", "info"] if cls is RankProgram else [])
    missing = [m for m in members if f"{prefix}.{m}" not in API]
    assert not missing, f"docs/api.md does not describe {cls.__name__}: {missing}"


def test_every_command_is_documented():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = [name for name in sub.choices if f"`autopar {name}" not in API]
    assert not missing, f"docs/api.md does not describe the commands {missing}"


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert not pages - linked, f"docs/index.md does not list {sorted(pages - linked)}"


def test_relative_links_resolve():
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"\w+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert not broken, f"broken links: {broken}"


def test_readme_options_are_real_options():
    readme = (DOCS.parent / "README.md").read_text()
    named = re.findall(r"^\| `(\w+)` \|", readme.split("The main options", 1)[1].split("\n\n", 2)[1], flags=re.M)
    assert named and not set(named) - set(CompileOptions.model_fields), set(named) - set(CompileOptions.model_fields)
