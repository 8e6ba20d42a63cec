"""The pass manager: runs passes in their written-out order and checks every graph after each.

A pass step maps a state to a state of the same type: the lowering's
:class:`~autopar.passes.lowering_state.LoweringState` (or any object with a ``graphs()`` method listing
its GraphModules, which become one per stage at the pipeline split), or a plain GraphModule. A step
says what kind of pass it is, and the check after it follows:

- ``transform``: each graph is linted and recompiled, and its shapes re-propagated on fake tensors.
  The whole graph runs on the example inputs, which also refreshes ``autopar.tensor`` and
  ``autopar.cost`` for the passes after it. A stage graph runs on inputs made from its placeholders'
  ``autopar.tensor``, and every node's value must have the shape and dtype its ``autopar.tensor``
  says (the meta is checked, not rewritten). A transform that hands back the very state it was given
  (nothing to do for this graph: a LoweringState is frozen, so a pass that changes anything returns a
  new one) changed nothing: the previous check still holds.
- ``analysis`` and ``check``: they write node meta or state fields, or raise; each graph must print
  as it did before the step (else a PassError), and the previous check still holds.
- ``capture``: it makes the graph; lint and recompile only, its shapes are propagated by the
  analysis that annotates it (after the checks that refuse what propagation could not run).

A step may run only for some Plans (``runs``: state -> bool, read when its turn comes). A failure
raises :class:`PassError` naming the pass, the graph and the passes that ran before it.

    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    >>> run_passes(gm, (PassStep("identity", lambda g: g, "a pass that changes nothing"),),
    ...            example_inputs=(torch.ones(1, 2),)) is gm
    True
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.errors import AutoparError, PassError
from autopar.ir.meta_keys import TENSOR, get_meta
from autopar.passes.frontend.annotate import annotate_tensors
from autopar.passes.frontend.shape_prop import MetaRun, to_fake

__all__ = ["PassStep", "run_passes", "HasGraphs", "check_stage_graph", "placeholder_inputs", "KINDS"]

log = logging.getLogger(__name__)

State = TypeVar("State")


class HasGraphs(Protocol):
    """A pass pipeline's state: its graphs, each named, with the example inputs it runs on (None: a stage graph)."""

    def graphs(self) -> Iterable[tuple[str, fx.GraphModule, tuple | None]]: ...


KINDS = ("transform", "analysis", "check", "capture")


@dataclass(frozen=True)
class PassStep:
    """One line of a pass pipeline: a name, a state -> state function, why it runs there, what kind of
    pass it is (:data:`KINDS`), when it runs (None: always) and which phase of the lowering holds it."""

    name: str
    fn: Callable
    why: str
    kind: str = "transform"
    runs: Callable | None = None
    phase: str = ""

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    @property
    def rewrites(self) -> bool:
        """Does the step change graphs (a transform, or the capture that makes one)?"""
        return self.kind in ("transform", "capture")


def placeholder_inputs(gm: fx.GraphModule) -> tuple:
    """Meta tensors shaped as each placeholder's ``autopar.tensor`` says (None where it is no tensor)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        info, val = get_meta(node, TENSOR), node.meta.get("val")
        if info is None or info.shape is None:
            out.append(None)
            continue
        stride = val.stride() if isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(info.shape) else None
        out.append(torch.empty(info.shape, dtype=info.dtype, device="meta") if stride is None
                   else torch.empty_strided(info.shape, stride, dtype=info.dtype, device="meta"))
    return tuple(out)


class _RegionsInside(MetaRun):
    """A meta run (without FLOP counting) that also runs every outlined region's ``body`` node by node."""

    def run(self, *args, **kwargs):
        return fx.Interpreter.run(self, *args, **kwargs)  # the fake mode per node, no counter

    def run_node(self, n: fx.Node):
        if n.op in ("placeholder", "output"):
            value = fx.Interpreter.run_node(self, n)
        elif n.op == "get_attr":
            value = to_fake(fx.Interpreter.run_node(self, n), self.mode)
        else:
            with self.mode:
                value = self._run_call(n)
        self.on_node(n, value, 0)
        return value

    def _run_call(self, n: fx.Node):
        module = self.fetch_attr(n.target) if n.op == "call_module" else None
        body = getattr(module, "body", None)
        if isinstance(body, fx.GraphModule) and getattr(module, "meta_forward", None) is None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return _RegionsInside(body, self.on_node, self.mode).run(*args, **kwargs)
        return super()._run_call(n)


def check_stage_graph(gm: fx.GraphModule) -> None:
    """Run a stage graph on meta; ValueError naming the first node whose value contradicts its ``autopar.tensor``.

    Collectives answer through their ``meta_forward``; an outlined region runs its own graph.
    """

    def compare(node: fx.Node, value, flops: int) -> None:
        info = get_meta(node, TENSOR)
        first = value[0] if isinstance(value, (tuple, list)) and value else value
        if info is None or info.shape is None or not isinstance(first, torch.Tensor):
            return
        if tuple(first.shape) != tuple(info.shape) or first.dtype != info.dtype:
            raise ValueError(f"node {node.name} computes {tuple(first.shape)} {first.dtype}, "
                             f"its autopar.tensor says {tuple(info.shape)} {info.dtype}")

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with torch.no_grad():
        _RegionsInside(gm, compare, mode).run(*to_fake(placeholder_inputs(gm), mode))


def _graphs(state, example_inputs) -> Iterable[tuple[str, fx.GraphModule, tuple | None]]:
    if isinstance(state, fx.GraphModule):
        return (("graph", state, example_inputs),)
    return state.graphs()


def _printed(state, example_inputs) -> dict[str, str]:
    """Each graph's printed form: what an analysis step must leave as it found it."""
    return {label: str(gm.graph) for label, gm, _ in _graphs(state, example_inputs)}


def _check_unchanged(before: dict[str, str], state, example_inputs) -> None:
    after = _printed(state, example_inputs)
    for label in sorted(set(before) | set(after)):
        if before.get(label) != after.get(label):
            raise _Invalid(label, ValueError("the step is declared an analysis (it may not rewrite) but changed "
                                             "the graph; declare it a transform to have its graphs re-checked"))


def _lint(state, example_inputs) -> None:
    """Lint and recompile every graph (what a new graph gets before its shapes are propagated)."""
    for label, gm, _ in _graphs(state, example_inputs):
        try:
            gm.graph.lint()
            gm.recompile()
        except Exception as exc:  # noqa: BLE001 - reported with the graph's name below
            raise _Invalid(label, exc) from exc


def _check(state, example_inputs) -> None:
    for label, gm, inputs in _graphs(state, example_inputs):
        try:
            gm.graph.lint()
            gm.recompile()
            if inputs is None:
                check_stage_graph(gm)
            else:
                annotate_tensors(gm, example_inputs=inputs)
        except Exception as exc:  # noqa: BLE001 - reported with the graph's name below
            raise _Invalid(label, exc) from exc


class _Invalid(Exception):
    def __init__(self, label: str, exc: Exception):
        super().__init__(f"{label}: {type(exc).__name__}: {exc}")
        self.label = label


def _after(step: PassStep, before, state, result, example_inputs) -> None:
    """The check that follows ``step`` (module docstring); ``before``: the graphs' printed form for an analysis."""
    if step.kind == "capture":
        _lint(result, example_inputs)
    elif step.rewrites and (result is not state or isinstance(state, fx.GraphModule)):  # (a graph: in place)
        _check(result, example_inputs)
    elif not step.rewrites:  # an analysis: the previous step's check still holds for the unchanged graphs
        _check_unchanged(before, result, example_inputs)


def run_passes(state: State, steps: Iterable[PassStep], *, example_inputs: tuple | None = None) -> State:
    """Run ``steps`` in order on ``state``, checking every graph after each (see the module docstring)."""
    done: list[str] = []
    for step in steps:
        if step.runs is not None and not step.runs(state):
            continue
        before = None if step.rewrites else _printed(state, example_inputs)
        try:
            result = step.fn(state)
        except AutoparError:
            raise
        except Exception as exc:  # noqa: BLE001 - a pass bug is reported with its context
            raise PassError(f"pass {step.name!r} failed: {type(exc).__name__}: {exc}",
                            where=f"after passes {done or ['<none>']}",
                            fix="report this graph to the autopar developers; "
                                "set tensor_parallel=False or pp=1 to avoid the pass") from exc
        try:
            _after(step, before, state, result, example_inputs)
        except _Invalid as exc:
            raise PassError(f"the graph is invalid after pass {step.name!r}: {exc}",
                            where=f"{exc.label}; passes run: {done + [step.name]}",
                            fix="report this graph to the autopar developers") from exc
        log.debug("pass %s ok (%s)", step.name, step.why)
        done.append(step.name)
        state = result
    return state
