"""Every python example in docs/ runs as written and prints what its comments say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCKS = [(path.name, i, block) for path in sorted(DOCS.glob("*.md"))
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))]


@pytest.mark.parametrize("name,index,block", BLOCKS, ids=[f"{n}-{i}" for n, i, _ in BLOCKS])
def test_example_runs(name, index, block, capsys):
    exec(compile(block, f"{name}[{index}]", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    promised = [line.split("#", 1)[1].strip() for line in block.splitlines()
                if line.lstrip().startswith("print(") and "#" in line]
    for expected in promised:
        assert any(expected in line for line in printed), f"{name}: expected {expected!r} in {printed}"
