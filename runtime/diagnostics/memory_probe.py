"""Measure what a rank actually holds: model-state bytes, and activations saved for backward.

- :func:`held_state_bytes` walks a :class:`~autopar.runtime.execution.program.RankProgram`'s tensors
  (stage-graph parameters and buffers, fp32 masters, every ``.grad`` (gradient slots' too: see
  :mod:`autopar.runtime.state.mixed_precision`), the optimizer's state)
  and sums each *storage* once (deduplicated by ``data_ptr``: a gradient that is a view of a
  flat bucket counts the bucket once, a tied weight once).
- :class:`SavedLedger` records the storages autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), plus what recompute regions hold (their inputs
  and the op outputs selective recompute stores); parameters, buffers and the batch's own
  tensors are excluded. Sizes are read when the stage's forward ends, so storage freed by then
  (ZeRO-3 frees gathered weights) counts zero.
- :func:`measure_activations` runs one ``train_step`` with a ledger around every stage forward
  and returns the bytes per (stage, microbatch).
- :func:`weight_version_bytes` sums what an asynchronous program holds besides its live weights:
  the weight copies its in-flight forwards read, the gradients of updates not applied yet and
  PipeMare's velocity (:mod:`autopar.memory.versions` predicts it).
- :func:`live_storages` counts every storage of a tensor the garbage collector finds alive in this
  process, and the collector's objects: what a long run must hold steady from one step to the next
  (tests/runtime/test_soak_held.py, bench/bench_soak.py).

The memory calculator (:mod:`autopar.memory`) uses the same ledger on fake tensors, so a
measured figure and a predicted one count the same things.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch

from autopar.ops.recompute import recompute_modules
from autopar.runtime.execution.rank_context import ProgramState

__all__ = ["StateBytes", "held_state_bytes", "SavedLedger", "measure_activations", "recording_activations",
           "weight_version_bytes", "LiveStorages", "live_storages"]


def _storage_key(t: torch.Tensor):
    """The storage's identity (its StorageImpl): unlike ``data_ptr`` it stays unique when a storage is
    resized to zero and its memory reused (ZeRO-3 frees gathered weights that way); fake tensors have one too."""
    return t.untyped_storage()._cdata


def _data_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SavedLedger:
    """Storages held for backward, each counted once; parameters, buffers and inputs excluded."""

    def __init__(self):
        self.held: dict[object, torch.UntypedStorage] = {}
        self.excluded: dict[object, torch.UntypedStorage] = {}  # kept alive: a key is never reused

    def exclude(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.excluded.setdefault(_storage_key(t), t.untyped_storage())

    def hold(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                self.held.setdefault(_storage_key(t), t.untyped_storage())

    def _pack(self, t: torch.Tensor):
        self.hold([t])
        return t

    def watch(self):
        """A context: every tensor autograd saves inside it is recorded."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def keys(self) -> set:
        return set(self.held) - set(self.excluded)

    def total(self) -> int:
        """Bytes of the held storages (their size now), excluded ones left out."""
        return sum(self.held[k].nbytes() for k in self.keys())

    def sizes(self) -> tuple[int, ...]:
        """Bytes of each held storage, excluded ones left out, in the order they were first saved."""
        return tuple(v.nbytes() for k, v in self.held.items() if k not in self.excluded)


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds for the model's state, by kind."""

    params: int
    master_params: int
    grads: int
    optimizer: int
    buffers: int

    @property
    def model_states(self) -> int:
        return self.params + self.master_params + self.grads + self.optimizer


class _Counter:
    def __init__(self):
        self.seen: set = set()
        self.total = 0

    def add(self, t) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            key = _data_ptr(t)  # everything counted here is alive: data_ptr identifies the memory
            if key not in self.seen:
                self.seen.add(key)
                self.total += t.untyped_storage().nbytes()


def held_state_bytes(program: ProgramState) -> StateBytes:
    """Bytes of every storage ``program`` holds for parameters, masters, gradients, optimizer state, buffers."""
    params, masters, grads, state, buffers = _Counter(), _Counter(), _Counter(), _Counter(), _Counter()
    compute = [p for gm in program.graphs.values() for p in gm.parameters()]
    for p in compute:
        params.add(p)
    mixed = getattr(program, "mixed", None)
    for m in mixed.masters if mixed is not None else []:  # ZeRO-1/2: only the masters this rank steps
        masters.add(m)
    fp32 = [m for _, m in mixed.named] if mixed is not None else []  # masters and gradient slots
    for p in compute + fp32:
        grads.add(p.grad)
    for gm in program.graphs.values():
        for b in gm.buffers():
            buffers.add(b)
    optimizer = getattr(program.optimizer, "optimizer", None)
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                state.add(value)
    return StateBytes(params.total, masters.total, grads.total, state.total, buffers.total)


def weight_version_bytes(program) -> int:
    """Bytes of the storages an asynchronous program (runtime/execution/async_pipeline.py) holds for weight versions
    now: copies, pending updates' gradients, PipeMare's velocity; 0 for a synchronous program."""
    versions = getattr(program, "versions", None)
    if versions is None:
        return 0
    held = _Counter()
    for t in versions.buffers() + list(getattr(program, "delta", None) or []):
        held.add(t)
    return held.total


@contextlib.contextmanager
def recording_activations(program, results: dict | None = None):
    """A context: a fresh ledger around every stage forward; yields {(stage, microbatch): bytes saved}."""
    results = {} if results is None else results
    handles = []
    for stage, gm in program.graphs.items():
        state: dict = {}

        def pre(module, args, stage=stage, state=state):
            ledger = SavedLedger()
            ledger.exclude(list(module.parameters()) + list(module.buffers()) + list(args))
            for region in recompute_modules(module):
                region.observer = ledger.hold
            state["ledger"], state["ctx"] = ledger, ledger.watch()
            state["ctx"].__enter__()

        def post(module, args, out, stage=stage, state=state):
            state["ctx"].__exit__(None, None, None)
            for region in recompute_modules(module):
                region.observer = None
            results[(stage, program.channel.microbatch)] = state["ledger"].total()

        handles += [gm.register_forward_pre_hook(pre), gm.register_forward_hook(post)]
    try:
        yield results
    finally:
        for h in handles:
            h.remove()


def measure_activations(program, *inputs: torch.Tensor, target: torch.Tensor) -> dict[tuple[int, int], int]:
    """Run one train_step; bytes saved for backward by each (stage, microbatch) forward of this rank."""
    with recording_activations(program) as results:
        program.train_step(*inputs, target=target)
    return results


@dataclass(frozen=True)
class LiveStorages:
    """What this process holds alive: tensor storages (each once) and their bytes, and the collector's objects."""

    count: int
    nbytes: int
    objects: int


def live_storages() -> LiveStorages:
    """Collect garbage, then count the storages of every tensor the collector finds (views and tied
    weights count their storage once) and every other object it tracks. Storages only C++ holds
    (autograd's saved tensors, a collective's buffer) are seen through the Python tensors that keep
    them alive. Python storage objects are left out of ``objects``: counting creates them, and they
    live as long as their storage."""
    gc.collect()
    storages: dict[int, int] = {}
    objects = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.UntypedStorage):
            continue
        objects += 1
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return LiveStorages(count=len(storages), nbytes=sum(storages.values()), objects=objects)
