"""A generated part of a Markdown page: the text between a begin and an end marker, rewritten in place.

    >>> import tempfile, pathlib
    >>> page = pathlib.Path(tempfile.mkdtemp()) / "page.md"
    >>> _ = page.write_text("intro\\n<!-- t -->\\nold\\n<!-- /t -->\\nrest\\n")
    >>> replace_marked(page, "<!-- t -->", "<!-- /t -->", "new"), replace_marked(page, "<!-- t -->", "<!-- /t -->", "new")
    (True, False)
    >>> page.read_text()
    'intro\\n<!-- t -->\\nnew\\n<!-- /t -->\\nrest\\n'
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["replace_marked"]


def replace_marked(path: Path, begin: str, end: str, body: str) -> bool:
    """Put ``body`` between the lines ``begin`` and ``end`` of ``path``; True if the file changed."""
    text = path.read_text()
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), flags=re.S)
    if not pattern.search(text):
        raise ValueError(f"{path} has no {begin} ... {end} markers")
    new = pattern.sub(lambda _m: f"{begin}\n{body}\n{end}", text)
    path.write_text(new)
    return new != text
