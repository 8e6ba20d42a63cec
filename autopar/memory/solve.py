"""The longest sequence and the largest microbatch that fit a device, solved from a :class:`MemoryFormula`.

A rank's bytes are ``Max`` of polynomials (one per point of its schedule where a forward has just
run, plus its recompute transient): the rank fits while every branch stays at or below the
capacity, so the longest sequence is, over ranks and branches, the least largest root of
``branch(s) = capacity`` (sympy solves each polynomial exactly), rounded down to a multiple of the
sequence step. The answer is then checked on the formula itself: it fits and one step more does not.

    >>> import autopar
    >>> from autopar.memory.formula import memory_formula
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), lm_loss, y = gpt_tiny()
    >>> formula = memory_formula(autopar.plan(model, (1, 1, 1), example_inputs=(x,), loss_fn=lm_loss,
    ...                                       example_target=y))
    >>> capacity = formula.peak(s=100)[1]
    >>> longest_sequence(formula, capacity=capacity)
    100
    >>> largest_microbatch(formula, capacity=capacity, s=100) == formula.microbatch_size
    True
"""
from __future__ import annotations

import itertools
import math

from autopar.memory.formula import MemoryFormula, symbols

__all__ = ["longest_sequence", "largest_microbatch", "branches", "describe", "fit_report"]

GiB = 2**30


def branches(expr) -> list:
    """The polynomials whose largest is ``expr`` (``Max`` and sums of ``Max`` spread out)."""
    import sympy
    if isinstance(expr, sympy.Max):
        return [x for arg in expr.args for x in branches(arg)]
    if isinstance(expr, (sympy.Add, sympy.Mul)) and any(a.has(sympy.Max) for a in expr.args):
        parts = [branches(a) for a in expr.args]
        return [expr.func(*combo) for combo in itertools.product(*parts)]
    return [expr]


def longest_sequence(formula: MemoryFormula, *, capacity: float, b: int | None = None, step: int = 1) -> int | None:
    """The longest sequence, a multiple of ``step``, at which every rank's bytes stay within ``capacity``
    with microbatches of ``b`` (default: the plan's); 0 when not even ``step`` fits; None when the
    bytes do not grow with the sequence (they fit at any length, or at none: see :meth:`MemoryFormula.peak`)."""
    sym = symbols()
    b = formula.microbatch_size if b is None else b
    return _solve(formula, var=sym["s"], fixed={sym["b"]: b}, capacity=capacity, step=step,
                  fits=lambda n: formula.peak(b=b, s=n)[1] <= capacity)


def largest_microbatch(formula: MemoryFormula, *, capacity: float, s: int | None = None) -> int | None:
    """The largest microbatch size at which every rank fits ``capacity`` at sequence ``s`` (default: the plan's)."""
    sym = symbols()
    fixed = {} if formula.seq_len is None else {sym["s"]: formula.seq_len if s is None else s}
    return _solve(formula, var=sym["b"], fixed=fixed, capacity=capacity, step=1,
                  fits=lambda n: formula.peak(b=n, s=s)[1] <= capacity)


def _solve(formula: MemoryFormula, *, var, fixed: dict, capacity: float, step: int, fits) -> int | None:
    import sympy
    point = {**fixed, symbols()["cp"]: 1}
    best = math.inf
    for rank in _distinct_ranks(formula):
        for branch in branches(sympy.expand(formula.expr(rank).subs(point))):
            best = min(best, _largest(sympy.Poly(branch, var), capacity, step))
    if best == math.inf:
        return None
    best = max(int(best), 0)
    while best > 0 and not fits(best):  # (a branch that dips: step down to a length that fits)
        best -= step
    return best


def _largest(poly, capacity: float, step: int) -> float:
    """The largest multiple of ``step`` at which ``poly`` stays within ``capacity`` (beyond its largest root)."""
    if poly.degree() <= 0:
        return math.inf if float(poly.as_expr()) <= capacity else 0
    if poly.LC() < 0:  # it falls as the size grows (no such bytes are measured; the check after catches a dip)
        return math.inf
    roots = [float(r) for r in (poly - capacity).real_roots()]
    if not roots:  # above the capacity everywhere
        return 0
    return max(math.floor(max(roots) / step) * step, 0)


def _distinct_ranks(formula: MemoryFormula) -> list[int]:
    """One rank per (states, pp rank): the others have the same bytes."""
    seen = {}
    for rank, states in formula.states.items():
        seen.setdefault((states, formula.coords[rank]["pp"]), rank)
    return list(seen.values())


def describe(expr) -> str:
    """A formula of bytes as a person reads it: ``64.76 GiB + 5.28 MiB·b·s`` (``cp`` = 1)."""
    import sympy
    expr = sympy.expand(expr.subs(symbols()["cp"], 1))
    if isinstance(expr, sympy.Max):
        return "max(" + ", ".join(describe(a) for a in expr.args) + ")"
    if isinstance(expr, sympy.Add):
        terms = sorted(expr.args, key=lambda t: (sympy.Poly(t, *sorted(t.free_symbols, key=str)).total_degree()
                                                  if t.free_symbols and not t.has(sympy.Max) else 0, str(t)))
        return " + ".join(describe(t) for t in terms).replace("+ -", "- ")
    coeff, rest = expr.as_coeff_Mul()
    if rest == 1:
        return _bytes(float(coeff))
    return f"{_bytes(float(coeff))}·{str(rest).replace('**', '^').replace('*', '·')}" if coeff != 1 else str(rest)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


def fit_report(formula: MemoryFormula, *, capacity: float, step: int = 1, where: str = "") -> list[str]:
    """What ``autopar plan --max-seq`` prints: the fullest rank's formula, the longest sequence and the
    largest microbatch that fit ``capacity`` bytes per device (``where``: the device, in words)."""
    b, s0 = formula.microbatch_size, formula.seq_len
    rank, _ = formula.peak()
    c = formula.coords[rank]
    lines = [f"memory of rank {rank} (dp={c['dp']} pp={c['pp']} tp={c['tp']}), b = microbatch size, s = sequence "
             f"length: {describe(formula.expr(rank))}"]
    device = f"{_bytes(capacity)} per device" + (f" ({where})" if where else "")
    longest = longest_sequence(formula, capacity=capacity, step=step) if s0 is not None else None
    if s0 is not None and longest is None:
        lines.append("longest sequence: memory does not grow with the sequence here")
    elif s0 is not None and longest == 0:
        need = formula.peak(b=b, s=step)
        lines.append(f"longest sequence that fits {device} at microbatch {b}: none, rank {need[0]} needs "
                     f"{need[1] / GiB:.2f} GiB at {step} token(s) (its model states alone: "
                     f"{formula.states[need[0]] / GiB:.2f} GiB)")
    elif s0 is not None:
        at, over = formula.peak(b=b, s=longest), formula.peak(b=b, s=longest + step)
        lines.append(f"longest sequence that fits {device} at microbatch {b}: {longest} tokens (rank {at[0]}: "
                     f"{at[1]:,} bytes of {int(capacity):,}; at {longest + step} tokens rank {over[0]} needs "
                     f"{over[1]:,})")
    largest = largest_microbatch(formula, capacity=capacity)
    at_s = f" at {s0} tokens" if s0 is not None else ""
    if largest:
        lines.append(f"largest microbatch that fits{at_s}: {largest} (rank {formula.peak(b=largest)[0]}: "
                     f"{formula.peak(b=largest)[1]:,} bytes; {largest + 1} needs {formula.peak(b=largest + 1)[1]:,})")
    elif largest == 0:
        lines.append(f"largest microbatch that fits{at_s}: none (microbatch 1 needs {formula.peak(b=1)[1] / GiB:.2f} GiB)")
    return lines
