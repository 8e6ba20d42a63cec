"""The stage graphs of each microbatch shape a rank runs: the compiled ones, a symbolic family, and a bounded cache.

A microbatch whose shape the compiled graphs take (the example's, or any size of the dims they
keep symbolic) runs on them. Another shape gets graphs of its own, built by the lowering
(``build``: :func:`autopar.shape_builder.make_builder`, handed in by ``compile``, so the runtime
imports no compiler):

- first, unless ``dynamic_shapes='static'``, once per new set of changed dims: the model is captured
  again at the example's shapes with every dim that changed symbolic (``torch.export``'s
  ``Dim.AUTO``); if the new shape is one of that graph's sizes, it and every later one like it run
  on it, with no capture more;
- else that exact shape is compiled on its own, logged, and kept in a cache of ``size`` shapes,
  the least recently used dropped first.

Every set of graphs shares the compiled graphs' parameters, buffers, gradients, optimizer state,
DDP buckets and ZeRO shards: ``bind`` points the new graphs' tensors at the compiled graphs' (by
name) and binds their collectives and send/recv nodes; only the graphs differ.

A batch past a symbolic dim's range (a sequence past the bound, one that does not divide by tp
under sequence parallelism) is refused with autopar's error naming the dim, the size and the fix
(:func:`check_sizes`).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from autopar.errors import AutoparError, InputError, PlanError
from autopar.ir.dynamic_shapes import DynamicDim, dim_label

__all__ = ["ShapeCache", "ShapeEntry", "check_sizes", "shapes_of", "past_bound"]

log = logging.getLogger(__name__)


def shapes_of(batch: dict, names: tuple[str, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The shapes of a microbatch's graph inputs (``names`` it holds), as a hashable key."""
    return tuple((n, tuple(batch[n].shape)) for n in names if isinstance(batch.get(n), torch.Tensor))


@dataclass
class ShapeEntry:
    """One set of stage graphs: the shapes they were built at and the dims they keep symbolic."""

    shapes: dict[str, tuple[int, ...]]
    stages: dict
    dynamic: tuple[DynamicDim, ...] = ()
    symbolic: frozenset = field(init=False)

    def __post_init__(self):
        self.symbolic = frozenset(pair for d in self.dynamic for pair in d.inputs)

    def covers(self, shapes) -> bool:
        """Whether every dim of ``shapes`` is this entry's, or one it keeps symbolic."""
        for name, shape in shapes:
            mine = self.shapes.get(name)
            if mine is None or len(mine) != len(shape):
                return False
            if any(a != b and (name, d) not in self.symbolic for d, (a, b) in enumerate(zip(mine, shape))):
                return False
        return True


def past_bound(name: str, size: int, axis: int, high: int, source: str, *, where: str) -> InputError:
    """The error of an input longer than the bound on ``axis``: the dim, the size, the bound and the fix."""
    label = dim_label(axis)
    unit = "tokens" if label == "seq" else "rows" if label == "rows" else "entries"
    if label == "rows":
        fix = f"pass at most {high} rows (the compiled microbatch size)"
    else:
        fix = (f"truncate to at most {high} (tokenizer(..., truncation=True, max_length={high})), or compile with "
               "a larger max_seq_len if the model takes longer sequences")
    return InputError(f"input {name!r} holds {size} {unit} on dim {axis} ({label}), past the bound {high} "
                      f"({source or 'the plan'})", where=where, fix=fix)


def check_sizes(dynamic: tuple[DynamicDim, ...], shapes, *, where: str) -> None:
    """Refuse a microbatch whose symbolic dims leave their range, break the multiple, or disagree."""
    by_name = dict(shapes)
    for dim in dynamic:
        seen = {name: by_name[name][axis] for name, axis in dim.inputs if name in by_name}
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{k} {v}" for k, v in seen.items())
            raise InputError(f"the batch's inputs disagree on {dim.label} (dim {dim.inputs[0][1]}): {listed}",
                             where=where, fix="pad them to one length together (one collator call pads the whole "
                                              "batch: input_ids, attention_mask and labels)")
        if not seen:
            continue
        name, size = next(iter(seen.items()))
        if dim.high is not None and size > dim.high:
            raise past_bound(name, size, dim.inputs[0][1], dim.high, dim.bound_source, where=where)
        if size < dim.low:
            raise InputError(f"input {name!r} holds {size} on dim {dim.inputs[0][1]} ({dim.label}); the program "
                             f"takes {dim.low}..{dim.high or 'any'}", where=where,
                             fix=f"pad to at least {dim.low} (the collator's pad_to_multiple_of does)")
        if size % dim.multiple_of:
            raise InputError(f"input {name!r} holds {size} on dim {dim.inputs[0][1]} ({dim.label}), which sequence "
                             f"parallelism splits over tp={dim.multiple_of}: {size} does not divide", where=where,
                             fix=f"pad to a multiple of {dim.multiple_of} (DataCollatorWithPadding(tokenizer, "
                                 f"pad_to_multiple_of={dim.multiple_of})), or compile with sequence_parallel=False")


class ShapeCache:
    """This rank's stage graphs per microbatch shape (module docstring)."""

    def __init__(self, *, base: ShapeEntry, build: Callable | None, bind: Callable, mode: str, size: int,
                 where: Callable[[], str], bound: tuple[int, str] | None = None):
        """``build(batch or None, marks)`` lowers this rank's stages (None: at the example's shapes; ``marks``:
        {input: dims} to keep symbolic); ``bind(lowered)`` makes them share the compiled graphs' state;
        ``bound``: (the Plan's max_seq_len, where it comes from), checked on dim 1 of a shape built alone."""
        self.base, self.build, self.bind, self.mode, self.size, self.where = base, build, bind, mode, size, where
        self.bound = bound
        self.family: ShapeEntry | None = None  # the symbolic recapture, once one was made
        self.exact: OrderedDict = OrderedDict()  # shape key -> ShapeEntry, least recently used first
        self.tried: set = set(base.symbolic)  # dims a symbolic recapture was asked for
        self.num_built = 0

    def entries(self) -> list[ShapeEntry]:
        """Every set of stage graphs held now."""
        return [self.base] + ([self.family] if self.family else []) + list(self.exact.values())

    def stages_for(self, batch: dict, names: tuple[str, ...]) -> dict:
        """The stage graphs for ``batch``'s shapes (built now if none takes them)."""
        shapes = shapes_of(batch, names)
        for entry in (self.base, self.family):
            if entry is not None and entry.covers(shapes):
                check_sizes(entry.dynamic, shapes, where=self.where())
                return entry.stages
        if shapes in self.exact:
            self.exact.move_to_end(shapes)
            return self.exact[shapes].stages
        self._check_new(shapes)
        entry = self._symbolic(batch, shapes)
        if entry is not None:
            check_sizes(entry.dynamic, shapes, where=self.where())
            return entry.stages
        return self._exact(batch, shapes).stages

    def _check_new(self, shapes) -> None:
        """Refuse a shape no graph can be built for: another rank of a tensor, a sequence past ``bound``."""
        for name, shape in shapes:
            mine = self.base.shapes.get(name)
            if mine is not None and len(mine) != len(shape):
                raise InputError(f"batch input {name!r} has {len(shape)} dims {shape}, the program was compiled on "
                                 f"{len(mine)} {mine}", where=self.where(),
                                 fix="pass each input as the example batch held it (the same dims, other sizes)")
            longer = mine is not None and len(shape) > 1 and shape[1] != mine[1]
            if longer and self.bound and shape[1] > self.bound[0]:
                raise past_bound(name, shape[1], 1, self.bound[0], self.bound[1], where=self.where())
        if self.build is None:
            raise PlanError(f"this program runs the shapes it was compiled for; the batch has {dict(shapes)}",
                            where=self.where(), fix="pass batches of the compiled shapes, or compile with "
                                                    "dynamic_shapes='seq' (any sequence length)")

    def _changed(self, shapes) -> set:
        return {(name, d) for name, shape in shapes for d, (a, b) in enumerate(zip(self.base.shapes[name], shape))
                if a != b} if all(n in self.base.shapes for n, _ in shapes) else set()

    def _symbolic(self, batch: dict, shapes) -> ShapeEntry | None:
        """A recapture with every dim that changed so far symbolic, if this shape brings new ones."""
        changed = self._changed(shapes)
        if self.mode == "static" or not changed or changed <= self.tried:
            return None
        self.tried |= changed
        marks: dict[str, tuple[int, ...]] = {}
        for name, d in sorted(self.tried):
            marks[name] = marks.get(name, ()) + (d,)
        began = time.perf_counter()
        try:
            lowered = self.build(None, marks)
        except AutoparError as exc:  # the model's code fixes these dims, or a pass needs them fixed
            log.warning("%s: a capture with %s symbolic failed (%s); each such shape is compiled on its own",
                        self.where(), marks, exc.what)
            return None
        entry = self._entry(lowered)
        if not entry.dynamic:
            log.info("%s: the dims %s stayed fixed in a new capture (the model's code fixes them); each such shape "
                     "is compiled on its own", self.where(), marks)
            return None
        self.family = entry
        log.info("%s: batch shapes %s: captured again with %s symbolic in %.1fs; every size of them runs on these "
                 "graphs", self.where(), dict(shapes), "; ".join(d.describe() for d in entry.dynamic),
                 time.perf_counter() - began)
        return entry if entry.covers(shapes) else None

    def _exact(self, batch: dict, shapes) -> ShapeEntry:
        began = time.perf_counter()
        entry = self._entry(self.build(batch, {}))
        self.exact[shapes] = entry
        if len(self.exact) > self.size:
            dropped, _ = self.exact.popitem(last=False)
            log.info("%s: dropped the graphs of batch shapes %s (shape_cache_size=%d)", self.where(), dict(dropped),
                     self.size)
        log.info("%s: batch shapes %s compiled on their own in %.1fs (%d of at most %d kept, shape_cache_size)",
                 self.where(), dict(shapes), time.perf_counter() - began, len(self.exact), self.size)
        return entry

    def _entry(self, lowered) -> ShapeEntry:
        self.num_built += 1
        stages = self.bind(lowered)
        dynamic = next((s.dynamic for s in stages.values()), ())
        return ShapeEntry(shapes=dict(lowered.example_shapes), stages=stages, dynamic=tuple(dynamic))
