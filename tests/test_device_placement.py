"""Every tensor the runtime creates names its device: on a GPU rank a buffer left on the default
device (CPU) would meet NCCL or a CUDA tensor and fail, so ``runtime/``, the graph ops it runs (``ops/``)
and the vocabulary it reads (``ir/``) may not rely on the default.

Read statically (ast): each call of a torch factory (``torch.zeros``, ``empty``, ``tensor``, ...) in
those folders passes ``device=`` (the rank's ``MeshInfo.device``, the device of a tensor at hand, or
an explicit ``"cpu"`` for host-side staging). ``*_like`` and ``new_*`` calls inherit their tensor's
device and are not flagged.
"""
from __future__ import annotations

import ast
import pathlib

FACTORIES = frozenset({"zeros", "empty", "ones", "full", "tensor", "arange", "randn", "rand", "randint", "eye",
                       "as_tensor", "empty_strided", "linspace"})
RUN_TIME = tuple(pathlib.Path(__file__).resolve().parents[1] / f for f in ("runtime", "ops", "ir"))


def deviceless_factories(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: torch.NAME`` of every torch factory call in ``source`` without a ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{filename}:{node.lineno}: torch.{node.func.attr}")
    return found


def test_every_runtime_factory_names_its_device():
    files = sorted(p for folder in RUN_TIME for p in folder.rglob("*.py"))
    assert len(files) > 20 and any(f.name == "p2p.py" for f in files)
    offenders = [hit for f in files for hit in deviceless_factories(f.read_text(), f.name)]
    assert not offenders, "pass device= (the rank's MeshInfo.device or a tensor's .device):\n" + "\n".join(offenders)


def test_the_scan_finds_a_deviceless_buffer():
    source = ("import torch\n"
              "def f(x):\n"
              "    a = torch.zeros(())\n"
              "    b = torch.empty(3, device=x.device)\n"
              "    c = torch.zeros_like(x)\n"
              "    return torch.tensor([1.0])\n")
    assert deviceless_factories(source) == ["<source>:3: torch.zeros", "<source>:6: torch.tensor"]
