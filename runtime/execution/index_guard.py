"""The run-time index guard: token ids and positions are range-checked before any stage reads them.

Fake tensors do not check indices, so planning cannot know whether a batch's token ids stay
below the embedding's rows. The inputs that index a table carry ``autopar.index_bound``
(written at capture by :mod:`autopar.passes.frontend.index_bounds`, copied onto every stage graph that
reads the input). Each step, before the schedule runs, every rank checks the inputs its own
stages read: one min and one max per input and microbatch, read back together (one host sync).

A rank that finds a value outside its table does not raise there, which would leave its peers
waiting for its activations and collectives until their deadline. It clamps the bad values so
its stages run the step with everyone else, and reports the problem in the step's one agreement
all-reduce, the non-finite check's (:func:`autopar.runtime.execution.numerics.check_finite`), so the good
case costs no extra collective. Then every rank raises the same
:class:`autopar.errors.IndexRangeError` naming the rank, the stage, the input, the values and
the bound, before the optimizer steps: the weights stay those of the last good step. Forward-only
calls (no non-finite check) agree with one all-reduce of their own (:meth:`IndexGuard.agree`).

Example::

    >>> guard = IndexGuard({}, active=False)
    >>> guard.inspect([{"idx": torch.tensor([1, 2])}]) is None
    True
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import IndexRangeError
from autopar.ir.meta_keys import range_text
from autopar.ir.meta_keys import INDEX_BOUND, get_meta

__all__ = ["IndexGuard", "graph_has_bounds", "index_error"]


def graph_has_bounds(gm) -> bool:
    """Whether any input of ``gm`` (the whole captured graph: the same on every rank) indexes a table."""
    return any(n.op == "placeholder" and get_meta(n, INDEX_BOUND) is not None for n in gm.graph.nodes)


class IndexGuard:
    """This rank's checks: (stage, input, bound) of each bounded input its stages read."""

    def __init__(self, stages: dict, *, active: bool, device: torch.device | str = "cpu"):
        self.device = torch.device(device)  # where the agreement's flag is all-reduced (NCCL: the GPU)
        self.active = active  # any rank checks something: then every rank takes part in agree()
        self.checks = []
        seen = set()
        for index, stage in sorted(stages.items()):
            for node in stage.gm.graph.nodes:
                bound = get_meta(node, INDEX_BOUND) if node.op == "placeholder" else None
                if bound is not None and node.name not in seen:
                    seen.add(node.name)
                    self.checks.append((index, node.name, bound))

    def inspect(self, microbatches: list[dict]) -> str | None:
        """What this rank's inputs hold outside their tables (None when all is well); bad values are clamped."""
        found = [(stage, name, bound, i, mb[name]) for stage, name, bound in self.checks
                 for i, mb in enumerate(microbatches) if isinstance(mb.get(name), torch.Tensor) and mb[name].numel()]
        if not found:
            return None
        ends = torch.stack([torch.stack([t.min(), t.max()]).long() for *_, t in found]).tolist()  # one host sync
        problem = None
        for (stage, name, bound, i, t), (low, high) in zip(found, ends):
            if bound.low <= low and high < bound.rows:
                continue
            if problem is None:
                problem = (f"input {name!r} of microbatch {i} holds values {int(low)}..{int(high)}, outside the "
                           f"table's {range_text(bound.low, bound.rows)} ({bound.lookups[0]}); stage {stage}")
            microbatches[i][name] = t.clamp(bound.low, bound.rows - 1)  # the stages run the step with their peers
        return problem

    def agree(self, problem: str | None, *, guard, rank: int, step: str) -> None:
        """Forward only: one all-reduce tells every rank whether any found a bad index; then all raise."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            if problem is not None:
                raise index_error([problem], step=step, offset=rank)
            return
        if not self.active:
            return
        flag = torch.tensor([0.0 if problem is None else 1.0], device=self.device)
        guard.run("all_reduce", dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=None,
                  purpose="the index range check (runtime/execution/index_guard.py)")
        if flag.item() == 0:
            return
        reports: list = [None] * dist.get_world_size()
        guard.call("all_gather_object", dist.all_gather_object, reports, problem, group=None,
                   purpose="the index range check's reports")
        raise index_error(reports, step=step)


def index_error(reports: list, *, step: str, offset: int = 0) -> IndexRangeError:
    """The one error every rank raises: the first rank's report, and how many other ranks found one."""
    bad = [(rank + offset, r) for rank, r in enumerate(reports) if r is not None]
    rank, what = bad[0]
    detail, _, stage = what.rpartition("; ")
    others = f"; {len(bad) - 1} other rank(s) too" if len(bad) > 1 else ""
    return IndexRangeError(
        f"an index out of range at {step}: {detail}{others}",
        where=f"rank {rank}, {stage}, {step}",
        fix="keep token ids below the embedding's rows (the model's vocabulary size) and positions below the "
            "position table (its maximum sequence length): check that the tokenizer matches the model; "
            "no optimizer step was taken, the weights are those of the last good step")
