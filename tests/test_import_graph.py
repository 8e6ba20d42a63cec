"""autopar's import graph, read from the source without importing it: layers hold and nothing imports in a circle.

Every ``import`` statement counts, at module level or inside a function (a lazy import is an import
all the same), absolute or relative. The source folders and the names they are installed under are
read from pyproject's ``[tool.setuptools.package-dir]``. The rules are ../shared/design.md section 6
as written (docs/architecture.md, "Layers"): an arrow never points back or sideways.

- ``autopar.ir``, the shared vocabulary (graph names, node meta keys, ShardLayout, the captured and
  stage graphs, dynamic dims), imports only itself and the base (``autopar.errors``,
  ``autopar.plan_model``, ``autopar.parallel_dims``);
- ``autopar.ops``, the differentiable collective, p2p and recompute ops, imports only itself, the
  vocabulary and the base;
- ``autopar.runtime.schedules`` (schedules as pure data) imports only itself and the base;
- ``autopar.runtime`` imports only the runtime, the ops, the vocabulary and the base: no module of
  ``autopar.passes``, never the lowering, the planner or ``compile``;
- ``autopar.passes`` imports only the passes, the ops, the vocabulary, the schedules (pure data) and the
  base: no executor, nothing else of the runtime;
- the base imports only the base, the vocabulary and the schedules;
- no import cycle among autopar's modules.
"""
from __future__ import annotations

import ast
import pathlib
import tomllib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = ("autopar.errors", "autopar.plan_model", "autopar.parallel_dims")
VOCABULARY = ("autopar.ir",)
OPS = ("autopar.ops",)
SCHEDULES = ("autopar.runtime.schedules",)  # schedules as pure data: no executor
LAYERS = {  # a layer -> what its modules may import (module names or packages)
    "autopar.ir": VOCABULARY + BASE,
    "autopar.ops": OPS + VOCABULARY + BASE,
    "autopar.runtime.schedules": SCHEDULES + BASE,
    "autopar.runtime": ("autopar.runtime",) + OPS + VOCABULARY + BASE,
    "autopar.passes": ("autopar.passes",) + OPS + VOCABULARY + SCHEDULES + BASE,
    **{base: BASE + VOCABULARY + SCHEDULES for base in BASE},
}


def source_folders(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """{import name: folder} of the installed packages (pyproject's package-dir)."""
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    dirs = config["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in dirs.items()}


def module_files(folders: dict[str, pathlib.Path]) -> dict[str, tuple[pathlib.Path, bool]]:
    """{module name: (file, is a package)} of every ``.py`` file under the folders."""
    out = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((package,) + (parts[:-1] if is_package else parts))
            out.setdefault(name, (path, is_package))  # a sub-package's own folder entry wins
    return out


def _resolve(name: str, known) -> str | None:
    """The autopar module ``name`` names: itself, else the package holding it (``autopar.x.func``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(source: str, *, module: str, is_package: bool, known) -> set[str]:
    """The autopar modules one file's source imports (every statement, at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for n in names if n.split(".")[0] == "autopar" and (t := _resolve(n, known)) != module
                     and t is not None)
    return found


def import_graph(files: dict[str, tuple[pathlib.Path, bool]]) -> nx.DiGraph:
    """An edge a -> b for each autopar module b that module a imports."""
    graph = nx.DiGraph()
    for module, (path, is_package) in files.items():
        graph.add_node(module)
        for target in imports_of(path.read_text(encoding="utf-8"), module=module, is_package=is_package,
                                 known=files):
            graph.add_edge(module, target)
    return graph


def _within(module: str, allowed) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def back_edges(graph: nx.DiGraph, layers: dict = LAYERS) -> list[tuple[str, str]]:
    """The imports a layer's modules may not make."""
    return sorted({(a, b) for a, b in graph.edges for layer, allowed in layers.items()
                   if _within(a, (layer,)) and not _within(b, allowed)})


def import_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """The groups of modules that import each other in a circle (each sorted, largest first)."""
    groups = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    return sorted(groups, key=lambda g: (-len(g), g))


def _cycle_text(graph: nx.DiGraph, group: list[str]) -> str:
    cycle = nx.find_cycle(graph.subgraph(group))
    return " -> ".join([a for a, _ in cycle] + [cycle[0][0]])


# -- the real source ---------------------------------------------------------------------------
GRAPH = import_graph(module_files(source_folders()))


def test_the_reader_sees_the_whole_source():
    """The graph holds every package and the edges everyone knows of (a reader that found nothing would pass)."""
    assert {"autopar.compile", "autopar.runtime.execution.program", "autopar.passes.frontend.capture",
            "autopar.ir.meta_keys", "autopar.ops.collectives", "autopar.runtime.schedules.registry",
            "autopar.models"} <= set(GRAPH.nodes)
    assert GRAPH.has_edge("autopar.compile", "autopar.lowering")
    assert GRAPH.has_edge("autopar.runtime.execution.program", "autopar.runtime.execution.executor")
    assert GRAPH.has_edge("autopar.runtime.state.materialize", "autopar.ops.zero3_ops")  # a lazy import
    assert GRAPH.number_of_edges() > 300


def test_runtime_and_passes_import_nothing_above_them():
    """runtime/ reads no pass, passes/ no executor; both the vocabulary, the ops and the base (design.md section 6)."""
    bad = back_edges(GRAPH)
    assert not bad, "imports against the layers: " + "; ".join(f"{a} -> {b}" for a, b in bad)


def test_no_import_cycle():
    """No autopar module imports, directly or through others, a module that imports it (lazy imports count)."""
    cycles = import_cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(_cycle_text(GRAPH, c) for c in cycles)


# -- the checks themselves can fail ------------------------------------------------------------
def _fake_tree(tmp_path: pathlib.Path, files: dict[str, str]) -> nx.DiGraph:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"autopar" = "autopar"\n'
                                             '"autopar.runtime" = "runtime"\n"autopar.passes" = "passes"\n'
                                             '"autopar.ir" = "ir"\n"autopar.ops" = "ops"\n')
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(module_files(source_folders(tmp_path)))


def test_every_kind_of_import_is_an_edge(tmp_path):
    """Module-level, lazy (in a function), ``import a.b``, ``from a import module``, relative: each is seen."""
    graph = _fake_tree(tmp_path, {
        "autopar/__init__.py": "", "autopar/lowering.py": "", "autopar/errors.py": "", "autopar/plan_model.py": "",
        "runtime/__init__.py": "",
        "runtime/a.py": "from autopar.errors import E\n",
        "runtime/b.py": "def f():\n    import autopar.lowering\n",
        "runtime/c.py": "from autopar import plan_model\n",
        "runtime/d.py": "from . import a\nfrom .b import f\nfrom .. import errors\n",
        "runtime/e.py": "import os, torch\nfrom autopar.runtime.a import thing\n",
    })
    assert set(graph.edges) == {
        ("autopar.runtime.a", "autopar.errors"), ("autopar.runtime.b", "autopar.lowering"),
        ("autopar.runtime.c", "autopar.plan_model"), ("autopar.runtime.d", "autopar.runtime.a"),
        ("autopar.runtime.d", "autopar.runtime.b"), ("autopar.runtime.d", "autopar.errors"),
        ("autopar.runtime.e", "autopar.runtime.a")}


def test_a_lazy_back_edge_fails(tmp_path):
    """A runtime module importing the lowering inside a function is a back edge."""
    graph = _fake_tree(tmp_path, {
        "autopar/__init__.py": "", "autopar/lowering.py": "", "autopar/errors.py": "", "runtime/__init__.py": "",
        "runtime/ok.py": "from autopar.errors import E\n",
        "runtime/bad.py": "def name(x):\n    from autopar.lowering import user_name\n    return user_name(x)\n",
    })
    assert back_edges(graph) == [("autopar.runtime.bad", "autopar.lowering")]


def test_a_cycle_through_a_lazy_import_fails(tmp_path):
    """Three modules in a circle, one edge of it lazy: found, and named in order."""
    graph = _fake_tree(tmp_path, {
        "autopar/__init__.py": "", "autopar/x.py": "import autopar.y\n", "autopar/y.py": "from autopar import z\n",
        "autopar/z.py": "def later():\n    from autopar.x import f\n", "autopar/w.py": "import autopar.x\n",
    })
    assert import_cycles(graph) == [["autopar.x", "autopar.y", "autopar.z"]]
    assert _cycle_text(graph, ["autopar.x", "autopar.y", "autopar.z"]).count("->") == 3


def test_the_layers_as_written_fail_each_wrong_arrow(tmp_path):
    """runtime -> a pass, passes -> an executor, ops -> the runtime, the vocabulary -> a pass, schedules -> the
    executor: each a back edge; the arrows design.md allows (down to the vocabulary, the ops, the schedules) are not."""
    empty = ["autopar/__init__.py", "autopar/errors.py", "runtime/__init__.py", "runtime/execution/executor.py",
             "runtime/schedules/__init__.py", "runtime/schedules/registry.py", "passes/__init__.py",
             "passes/pipeline/pipeline_split.py", "ir/__init__.py", "ir/meta_keys.py", "ops/__init__.py", "ops/p2p.py"]
    graph = _fake_tree(tmp_path, dict.fromkeys(empty, "") | {
        "runtime/ok.py": "from autopar.ir import meta_keys\nfrom autopar.ops.p2p import Send\nimport autopar.errors\n",
        "runtime/bad.py": "def stage():\n    from autopar.passes.pipeline.pipeline_split import split\n",
        "passes/ok.py": "from autopar.runtime.schedules.registry import family\nfrom autopar.ops import p2p\n"
                        "from autopar.ir.meta_keys import PARAM\n",
        "passes/bad.py": "from autopar.runtime.execution.executor import run_actions\n",
        "ops/bad.py": "from autopar.runtime.execution import executor\n",
        "ir/bad.py": "from autopar.passes.pipeline import pipeline_split\n",
        "runtime/schedules/bad.py": "from ..execution.executor import run_actions\n",
    })
    assert back_edges(graph) == [
        ("autopar.ir.bad", "autopar.passes.pipeline.pipeline_split"),
        ("autopar.ops.bad", "autopar.runtime.execution.executor"),
        ("autopar.passes.bad", "autopar.runtime.execution.executor"),
        ("autopar.runtime.bad", "autopar.passes.pipeline.pipeline_split"),
        ("autopar.runtime.schedules.bad", "autopar.runtime.execution.executor")]
