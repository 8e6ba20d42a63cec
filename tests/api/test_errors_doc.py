"""docs/errors.md: every row names a test, and that test exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_of_the_errors_page_names_an_existing_test():
    rows = [line for line in (ROOT / "docs" / "errors.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| wrong input") and not line.startswith("| ---")]
    assert len(rows) >= 30
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row)
        assert named, f"row names no test: {row}"
        for path, name in named:
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, flags=re.M), f"{path} has no {name} (row: {row[:80]})"
