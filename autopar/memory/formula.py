"""The memory calculator's per-rank bytes as formulas (sympy) of the plan's free sizes.

A Plan fixes the mesh, the schedule, the microbatch count and the stage cuts; what is left free is
the microbatch size ``b`` and the sequence length ``s``. :func:`memory_formula` writes every rank's
bytes as ``states + activations(b, s)``: the model states and buffers are the calculator's own
figures (they do not depend on b or s); the activations are the calculator's fake run
(:func:`autopar.memory.activations.stage_activations`) read at a second shape. Each storage a
stage saves for backward is a product of dims, so its bytes are ``c · b^i · s^j``: the plan's own
shape ``(b0, s0)`` and a second one ``(3·b0, s0/2)`` tell ``i`` and ``j`` apart by the ratio of
the two sizes (``3^i / 2^j`` names one pair), and a third, ``(2·b0, s0/2)``, checks the result
against the calculator there (a mismatch is a PlanError, never a wrong formula). A rank's peak is
then the largest, over the points of its schedule where it has just run a forward, of its stages'
in-flight counts times their formulas, plus its largest recompute transient: ``Max(...)`` of
polynomials, which :mod:`autopar.memory.solve` solves for the longest sequence or the largest
microbatch that fits.

Room for context parallelism: the activations are written of the sequence each rank holds, ``s /
cp`` (``cp`` = 1 until autopar shards the sequence over ranks; the calculator must then be checked
on cp plans, as ``tests/api/test_memory_formula.py`` checks it on the others).

    >>> import autopar
    >>> from autopar.models.examples import gpt_tiny
    >>> model, (x,), lm_loss, y = gpt_tiny()
    >>> result = autopar.plan(model, (1, 2, 1), example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    >>> formula = memory_formula(result, optimizer="adam")
    >>> formula.bytes(0) == estimate_memory(result, optimizer="adam").ranks[0].total
    True
    >>> formula.bytes(0, b=4, s=64) > formula.bytes(0)
    True
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction

from autopar.errors import PlanError
from autopar.memory.activations import stage_activations
from autopar.memory.calculator import _stages, estimate_memory

__all__ = ["MemoryFormula", "memory_formula", "symbols"]

log = logging.getLogger(__name__)


def symbols() -> dict:
    """``b`` (microbatch size), ``s`` (sequence length) and ``cp`` (context-parallel degree), positive integers."""
    import sympy
    return {name: sympy.Symbol(name, integer=True, positive=True) for name in ("b", "s", "cp")}


@dataclass(frozen=True)
class MemoryFormula:
    """Per-rank bytes as ``states[rank] + activations[pp](b, s)``; see the module doc.

    ``seq_len`` is None for a model whose inputs have no sequence dim (then ``s`` is absent).
    """

    states: dict  # rank -> bytes of parameters, masters, gradients, optimizer state and buffers
    activations: dict  # pp rank -> sympy expression of b, s, cp: the peak activation bytes
    coords: dict  # rank -> {"dp", "pp", "tp"}
    microbatch_size: int
    seq_len: int | None
    optimizer: str

    def expr(self, rank: int):
        """Rank ``rank``'s bytes as a sympy expression of ``b``, ``s`` and ``cp``."""
        return self.states[rank] + self.activations[self.coords[rank]["pp"]]

    def bytes(self, rank: int, *, b: int | None = None, s: int | None = None) -> int:
        """Rank ``rank``'s bytes at microbatch size ``b`` and sequence ``s`` (default: the plan's)."""
        return self.states[rank] + _value(self.activations[self.coords[rank]["pp"]], self._point(b, s))

    def peak(self, *, b: int | None = None, s: int | None = None) -> tuple[int, int]:
        """(rank, bytes) of the fullest rank at (b, s)."""
        point = self._point(b, s)
        per_pp = {pp: _value(e, point) for pp, e in self.activations.items()}
        return max(((r, n + per_pp[self.coords[r]["pp"]]) for r, n in self.states.items()),
                   key=lambda x: (x[1], -x[0]))

    def _point(self, b, s) -> dict:
        sym = symbols()
        point = {sym["b"]: self.microbatch_size if b is None else b, sym["cp"]: 1}
        if self.seq_len is not None:
            point[sym["s"]] = self.seq_len if s is None else s
        return point


def _value(expr, point: dict) -> int:
    return int(expr.subs(point))


def memory_formula(result, *, optimizer: str = "adam", zero_stage: int | None = None, seq_dim: int | None = 1
                   ) -> MemoryFormula:
    """The memory formula of ``result`` (an :class:`autopar.PlanResult` from :func:`autopar.plan`).

    ``seq_dim``: the dim of the first input that is the sequence (None: no sequence, ``b`` only).
    Plans the model twice more (one tensor-parallel rank, at the module doc's two shapes).
    """
    import sympy

    source = getattr(result, "source", None)
    if source is None:
        raise PlanError("this PlanResult does not hold the model it was planned from", where="memory_formula(result)",
                        fix="pass the result of autopar.plan(...) itself")
    estimate = estimate_memory(result, optimizer=optimizer, zero_stage=zero_stage)
    b0, s0 = result.plan.microbatch_size, _seq_len(source.example_inputs, seq_dim)
    if s0 is not None and s0 % 2:
        raise PlanError(f"the sequence length {s0} is odd: the formula is read at s/2", where="example_inputs",
                        fix="plan with an even sequence length (the formula holds for every length)")
    half = None if s0 is None else s0 // 2
    base = _pieces(result)
    second = _pieces(_replan(result, batch=3 * b0, seq=half, seq_dim=seq_dim))
    check_result = _replan(result, batch=2 * b0, seq=half, seq_dim=seq_dim)
    sym = symbols()
    local = sym["s"] / sym["cp"]
    terms = _Terms(b0=b0, s0=s0, sym=sym, local=local)
    activations = {}
    for pp, stages in base.items():
        saved = {k: terms.sum(base[pp][k].pieces, second[pp][k].pieces, where=f"pp rank {pp}, stage {k}")
                 for k in stages}
        transient = [terms.sum(a[0], c[0], where=f"stage {k}") - terms.sum(a[1], c[1], where=f"stage {k}")
                     for k in stages for a, c in zip(base[pp][k].regions, second[pp][k].regions)]
        activations[pp] = _peak(result.schedule.actions[pp], saved, split_backward=result.schedule.split_backward) \
            + sympy.Max(0, *transient)
    formula = MemoryFormula(states={r: m.model_states + m.buffers for r, m in estimate.ranks.items()},
                            activations=activations, coords={r: m.coords for r, m in estimate.ranks.items()},
                            microbatch_size=b0, seq_len=s0, optimizer=optimizer)
    _check(formula, estimate_memory(check_result, optimizer=optimizer, zero_stage=zero_stage), b=2 * b0, s=half)
    return formula


class _Terms:
    """Turns the pieces of one storage list at the two shapes into ``sum(c · b^i · (s/cp)^j)``."""

    def __init__(self, *, b0: int, s0: int | None, sym: dict, local):
        self.b0, self.s0, self.sym, self.local = b0, s0, sym, local

    def sum(self, first, second, *, where: str):
        import sympy
        if len(first) != len(second):
            raise PlanError(f"{where} saves {len(first)} tensors at one shape and {len(second)} at another",
                            where=where, fix="report it: the graph should not change with the batch or sequence size")
        total = sympy.Integer(0)
        for x, y in zip(first, second):
            i, j = self._exponents(Fraction(y, x) if x else Fraction(1), where=where, sizes=(x, y))
            coeff = sympy.Rational(x, self.b0 ** i * (self.s0 or 1) ** j)
            total += coeff * self.sym["b"] ** i * self.local ** j
        return total

    def _exponents(self, ratio: Fraction, *, where: str, sizes) -> tuple[int, int]:
        for i in range(4):
            for j in range(4 if self.s0 is not None else 1):
                if Fraction(3) ** i / Fraction(2) ** j == ratio:
                    return i, j
        raise PlanError(f"a tensor {where} saves for backward grows from {sizes[0]} to {sizes[1]} bytes when the "
                        f"microbatch triples and the sequence halves: not a product of batch and sequence dims",
                        where=where, fix="the memory formula needs activations made of batch and sequence dims; "
                                          "use estimate_memory at each size instead")


def _peak(row, saved: dict, *, split_backward: bool):
    """Max, over the points of ``row`` right after a forward, of the in-flight stage counts times ``saved``."""
    import sympy
    from autopar.runtime.schedules.action import ActionKind

    release = ActionKind.W if split_backward else ActionKind.B
    held = dict.fromkeys(saved, 0)
    points = set()
    for action in row:
        if action.kind is ActionKind.F:
            held[action.stage] += 1
            points.add(tuple(held.values()))
        elif action.kind is release:
            held[action.stage] -= 1
    kept = [p for p in points if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in points)]
    stages = list(saved)
    return sympy.Max(0, *(sum(n * saved[k] for n, k in zip(p, stages)) for p in kept))


def _pieces(planned) -> dict:
    """{pp rank: {stage: StageActivations}} of ``planned`` (a PlanResult at some shape), read like the calculator:
    the first built rank of each pp rank stands for its tp ranks."""
    memo, out = {}, {}
    for graphs in planned.ranks.values():
        pp = graphs.coords["pp"]
        if pp not in out:
            stages = [s for s in _stages(planned, pp, graphs.coords["tp"])
                      if planned.schedule.stage_to_rank[s.stage] == pp]
            out[pp] = {s.stage: stage_activations(s.gm, memo=memo) for s in stages}
    return dict(sorted(out.items()))


def _check(formula: MemoryFormula, estimate, *, b: int, s) -> None:
    for rank, m in estimate.ranks.items():
        if rank in formula.states and formula.bytes(rank, b=b, s=s) != m.total:
            raise PlanError(f"the memory formula of rank {rank} gives {formula.bytes(rank, b=b, s=s)} bytes at "
                            f"b={b}, s={s} where the calculator gives {m.total}",
                            where=f"memory_formula, rank {rank}",
                            fix="use estimate_memory at each size; report the model (it breaks the formula's rule)")


def _seq_len(example_inputs, seq_dim) -> int | None:
    from autopar.lowering import batch_inputs
    _keys, tensors = batch_inputs(example_inputs)
    if seq_dim is None:
        return None
    first = tensors[0]
    if first.dim() <= seq_dim:
        raise PlanError(f"the first input has shape {tuple(first.shape)}: no dim {seq_dim} for the sequence",
                        where="memory_formula(seq_dim=...)", fix="pass seq_dim=None for a model without a sequence")
    return int(first.shape[seq_dim])


def _replan(result, *, batch: int, seq: int | None, seq_dim: int | None):
    """``result``'s Plan again, tp rank 0 of every pp rank, with microbatches of ``batch`` samples of ``seq``."""
    import autopar
    from autopar.planning import rank_of

    src, plan = result.source, result.plan
    shape = plan.mesh
    global_batch = batch * shape.dp * plan.pipeline.num_microbatches
    b_old, s_old = plan.global_batch_size, _seq_len(src.example_inputs, seq_dim)

    def resize(value):
        return _resized(value, b_old=b_old, s_old=s_old, batch=global_batch, seq=seq, seq_dim=seq_dim)

    inputs = src.example_inputs
    inputs = {k: resize(v) for k, v in inputs.items()} if isinstance(inputs, dict) else \
        tuple(resize(t) for t in inputs) if isinstance(inputs, (tuple, list)) else resize(inputs)
    pps = sorted({g.coords["pp"] for g in result.ranks.values()})
    log.info("memory formula: planning again at microbatch %d, sequence %s", batch, seq)
    return autopar.plan(src.model, shape, example_inputs=inputs, loss_fn=src.loss_fn,
                        example_target=resize(src.example_target), ranks=[rank_of(dp=0, pp=q, tp=0, shape=shape)
                                                                          for q in pps],
                        plan=plan.model_copy(update={"global_batch_size": global_batch}),
                        **_analysis_options(result))


def _analysis_options(result) -> dict:
    from autopar.options import ANALYSIS_OPTIONS
    options = result.captured.options
    return {k: getattr(options, k) for k in ANALYSIS_OPTIONS}


def _resized(t, *, b_old: int, s_old, batch: int, seq, seq_dim):
    """``t`` with dim 0 (``b_old`` long) made ``batch`` and the sequence dim (``s_old``) made ``seq``: the values
    tiled (token ids stay valid), or empty on the meta device."""
    import torch
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b_old:
        return t
    shape = list(t.shape)
    shape[0] = batch
    if seq_dim is not None and t.dim() > seq_dim and t.shape[seq_dim] == s_old:
        shape[seq_dim] = seq
    if t.device.type == "meta":
        return torch.empty(shape, dtype=t.dtype, device="meta")
    reps = [math.ceil(n / o) for n, o in zip(shape, t.shape)]
    return t.repeat(*reps)[tuple(slice(0, n) for n in shape)].clone()
