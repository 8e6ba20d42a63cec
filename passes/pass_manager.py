"""The pass manager: runs passes in their written-out order and checks the graph after each.

After every pass: ``graph.lint()``, recompile, and shape re-propagation on fake tensors (which also
refreshes ``autopar.tensor`` and ``autopar.cost``). A failure raises :class:`PassError` naming
the pass and the passes that ran before it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from autopar.errors import AutoparError, PassError
from autopar.passes.annotate import annotate_tensors

__all__ = ["PassStep", "run_passes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassStep:
    """One line of a pass pipeline: a name, a GraphModule -> GraphModule function, and why it runs there."""

    name: str
    fn: Callable[[fx.GraphModule], fx.GraphModule]
    why: str


def _check(gm: fx.GraphModule, example_inputs: tuple) -> None:
    gm.graph.lint()
    gm.recompile()
    annotate_tensors(gm, example_inputs=example_inputs)


def run_passes(gm: fx.GraphModule, steps: tuple[PassStep, ...], *, example_inputs: tuple) -> fx.GraphModule:
    """Run ``steps`` in order on ``gm``, checking the graph after each."""
    done: list[str] = []
    for step in steps:
        try:
            gm = step.fn(gm)
        except AutoparError:
            raise
        except Exception as exc:  # noqa: BLE001 - a pass bug is reported with its context
            raise PassError(f"pass {step.name!r} failed: {type(exc).__name__}: {exc}",
                            where=f"after passes {done or ['<none>']}",
                            fix="report this graph to the autopar developers; "
                                "set tensor_parallel=False or pp=1 to avoid the pass") from exc
        try:
            _check(gm, example_inputs)
        except Exception as exc:  # noqa: BLE001
            raise PassError(f"the graph is invalid after pass {step.name!r}: {type(exc).__name__}: {exc}",
                            where=f"passes run: {done + [step.name]}",
                            fix="report this graph to the autopar developers") from exc
        log.debug("pass %s ok (%s)", step.name, step.why)
        done.append(step.name)
    return gm
