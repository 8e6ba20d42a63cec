"""Result rows of the benchmarks, as a console table and as sections of ``docs/benchmarks.md``.

A row is a dict with the keys of :data:`COLUMNS`. Each benchmark owns one section of the
document, fenced by ``<!-- bench:NAME -->`` / ``<!-- /bench:NAME -->`` markers, so running one
benchmark rewrites only its own section; ``run_all.py`` rewrites the whole file.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import time

import torch

__all__ = ["COLUMNS", "DOC_PATH", "console_table", "markdown_table", "markdown_rows", "machine_line", "today",
           "update_section", "fence", "stamped", "run_note"]

DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "benchmarks.md")

#: (key, header, format) of every column.
COLUMNS = (
    ("case", "case", "{}"),
    ("autopar", "autopar", "{}"),
    ("peer", "torch peer", "{}"),
    ("autopar_s", "autopar s/step", "{:.3f}"),
    ("peer_s", "peer s/step", "{:.3f}"),
    ("ratio", "wall ratio autopar/peer", "{:.3f}"),
    ("round_iqr", "per-round wall ratio, quartiles", "{}"),
    ("cpu", "CPU s/step autopar / peer", "{}"),
    ("cpu_ratio", "CPU ratio", "{:.3f}"),
    ("loss1", "step-1 loss autopar / peer", "{}"),
    ("loss_last", "last loss autopar / peer", "{}"),
    ("steps", "timed steps each", "{}"),
)


def _cells(row: dict) -> list[str]:
    return [fmt.format(row[key]) for key, _, fmt in COLUMNS]


def console_table(rows: list[dict]) -> str:
    """A fixed-width table for stdout."""
    header = [h for _, h, _ in COLUMNS]
    body = [_cells(r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


def markdown_table(rows: list[dict]) -> str:
    """A GitHub markdown table of result rows (``COLUMNS``)."""
    return markdown_rows([h for _, h, _ in COLUMNS], [_cells(r) for r in rows])


def markdown_rows(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table of ``header`` and ``rows`` of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def today() -> str:
    """The output of ``date`` (the machine's local date and time)."""
    return subprocess.run(["date"], capture_output=True, text=True, check=False).stdout.strip()


def machine_line() -> str:
    """CPU model, core count, Python and torch versions."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, gloo backend, 2 ranks x 1 thread")


def stamped(fn, *args, **kwargs) -> list[dict]:
    """Call ``fn`` (which returns rows); add the date, wall time and load averages to every row."""
    load_before, date = os.getloadavg()[0], today()
    t0 = time.perf_counter()
    rows = fn(*args, **kwargs)
    stamp = dict(date=date, wall_s=time.perf_counter() - t0, load_before=load_before,
                 load_after=os.getloadavg()[0])
    return [{**row, **stamp} for row in rows]


def run_note(rows: list[dict]) -> str:
    """One line: when it ran, how long it took, how busy the machine was (1-min load average)."""
    r = rows[0]
    return (f"Measured {r['date']}; the whole benchmark took {r['wall_s']:.0f} s; 1-minute load average "
            f"{r['load_before']:.1f} before, {r['load_after']:.1f} after (2 cores).")


def fence(name: str, body: str) -> str:
    """``body`` wrapped in the markers of section ``name``."""
    return f"<!-- bench:{name} -->\n{body.strip()}\n<!-- /bench:{name} -->"


def update_section(name: str, body: str, *, path: str = DOC_PATH) -> None:
    """Replace section ``name`` of the document (append it if missing; create the file if needed)."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    new = fence(name, body)
    text = pattern.sub(lambda _: new, text) if pattern.search(text) else text.rstrip() + "\n\n" + new + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
