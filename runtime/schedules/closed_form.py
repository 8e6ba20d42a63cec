"""A schedule family's figures as formulas (sympy) in ``p`` ranks, ``m`` microbatches, ``v`` stages per rank.

Each family's row in :mod:`autopar.runtime.schedules.registry` writes its formulas as text, the way
the papers print them; they are parsed on first use (sympy is not imported before). The unit is one
stage's forward: every stage's F, B (input gradient) and W (weight gradient) cost 1, a backward
that is not split costs 2, and transfers are free.

- ``step``: the step time, from the first action to the last (a flush at the end);
- ``busy``: one rank's work in the step; the **bubble** is ``1 - busy / step`` (every rank of a
  family does the same work);
- ``peak``: the (stage, microbatch) activations rank ``r`` holds at its peak, the simulator's
  ``peak_activations``;
- ``requires``: where the generator builds the schedule (elsewhere the figures raise its error);
  ``step_holds`` / ``peak_holds``: where the formulas are exact, when that is less.

``tests/runtime/test_schedule_closed_forms.py`` checks every formula against the simulator on a grid
of ``p``, ``m`` and ``v``; docs/schedules.md prints :func:`closed_forms_markdown`.

    >>> form = ClosedForm(placement=None, step="3*(m + p - 1)", busy="3*m", peak="p - r",
    ...                   requires=("m >= p", "1f1b needs num_microbatches >= {p}"))
    >>> form.bubble_expr
    (p - 1)/(m + p - 1)
    >>> form.bubble(4, 8, 1), form.peaks(4, 8, 1)
    (0.2727272727272727, (4, 3, 2, 1))
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

from autopar.errors import ScheduleError

__all__ = ["ClosedForm", "SYMBOLS", "parse", "closed_forms_markdown"]

SYMBOLS = ("p", "m", "v", "r")
"""ranks, microbatches, stages per rank (per replica), and the rank a per-rank formula is about."""


@functools.lru_cache(maxsize=None)
def _symbols() -> dict:
    import sympy
    return {name: sympy.Symbol(name, integer=True, **({"nonnegative": True} if name == "r" else {"positive": True}))
            for name in SYMBOLS}


@functools.lru_cache(maxsize=None)
def parse(text: str):
    """The sympy expression (or condition) written as ``text`` in ``p``, ``m``, ``v``, ``r``."""
    import sympy
    return sympy.sympify(text, locals=_symbols())


@functools.lru_cache(maxsize=None)
def _compiled(text: str) -> Callable:
    """``text`` as a plain Python function of (p, m, v, r)."""
    import sympy
    s = _symbols()
    return sympy.lambdify([s[n] for n in SYMBOLS], parse(text), modules="math")


class ClosedForm(NamedTuple):
    """A family's placement (a function of pp, v) and its figures as formulas; see the module doc."""

    placement: Callable[[int, int], tuple[int, ...]] | None
    step: str
    busy: str
    peak: str
    requires: tuple[str, str] | None = None  # (condition, error message with {p} {m} {v}) of the generator
    step_holds: str = "True"
    peak_holds: str = "True"
    note: str = ""  # how the formulas were found, for the docs

    @property
    def step_expr(self):
        return parse(self.step)

    @property
    def bubble_expr(self):
        """``1 - busy / step`` (simplified)."""
        import sympy
        return sympy.factor(sympy.cancel(1 - parse(self.busy) / parse(self.step)))

    def bubble_text(self) -> str:
        """The bubble as printed: one fraction where the step is a polynomial, else ``1 - busy/(step)``."""
        step = parse(self.step)
        if step.is_polynomial(*_symbols().values()):
            return str(self.bubble_expr)
        return f"1 - {parse(self.busy)}/({step})"

    @property
    def peak_expr(self):
        return parse(self.peak)

    def _check(self, pp: int, m: int, v: int) -> None:
        if self.requires is not None and not _compiled(self.requires[0])(pp, m, v, 0):
            raise ScheduleError(f"{self.requires[1].format(p=pp, m=m, v=v)}, got {m}")

    def step_holds_at(self, pp: int, m: int, v: int) -> bool:
        """Whether ``step`` and the bubble are exact at (pp, m, v) (the generator must build there too)."""
        return bool(_compiled(self.step_holds)(pp, m, v, 0))

    def peak_holds_at(self, pp: int, m: int, v: int) -> bool:
        return bool(_compiled(self.peak_holds)(pp, m, v, 0))

    def step_time(self, pp: int, m: int, v: int) -> float:
        """The step time in the unit of the module doc."""
        self._check(pp, m, v)
        return float(_compiled(self.step)(pp, m, v, 0))

    def bubble(self, pp: int, m: int, v: int) -> float:
        """The mean idle share of a step with equal F, B and W costs."""
        self._check(pp, m, v)
        return 1.0 - float(_compiled(self.busy)(pp, m, v, 0)) / float(_compiled(self.step)(pp, m, v, 0))

    def peaks(self, pp: int, m: int, v: int) -> tuple[int, ...]:
        """Per rank, the (stage, microbatch) activations it holds at its peak."""
        self._check(pp, m, v)
        peak = _compiled(self.peak)
        return tuple(int(round(peak(pp, m, v, r))) for r in range(pp))


def _cell(expr) -> str:
    text = re.sub(r"Eq\(Mod\((\w+), (\w+)\), 0\)", r"(\1 % \2 == 0)", str(expr))
    return f"`{text}`".replace("|", "\\|")


def _where(form: ClosedForm) -> str:
    parts = [f"built for {_cell(parse(form.requires[0]))}"] if form.requires else []
    if form.step_holds == form.peak_holds != "True":
        parts.append(f"exact for {_cell(parse(form.step_holds))}")
    else:
        parts += [f"{what} exact for {_cell(parse(cond))}" for what, cond in
                  (("step", form.step_holds), ("peak", form.peak_holds)) if cond != "True"]
    return "; ".join(parts + ([form.note] if form.note else [])) or "every m"


def closed_forms_markdown(forms: dict[str, ClosedForm]) -> str:
    """The table docs/schedules.md prints between its ``closed-forms`` markers (one row per family)."""
    rows = ["| schedule | step time | bubble | peak activations of rank `r` | where |", "|---|---|---|---|---|"]
    rows += [f"| `{name}` | {_cell(form.step_expr)} | {_cell(form.bubble_text())} | {_cell(form.peak_expr)} | "
             f"{_where(form)} |" for name, form in forms.items()]
    return "\n".join(rows)
