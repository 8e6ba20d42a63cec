"""The model's own initialisers, replayed one module at a time: a filler for :mod:`autopar.runtime.state.materialize`.

A meta-built model has shapes but no values. :func:`init_filler` gives each rank the values a
build of the same model on CPU draws under the same seed, while holding real storage for only
one module's tensors at a time (plus the pieces the rank keeps):

- **construction**, in construction order (``named_children``, depth first): a module with its own
  ``reset_parameters`` (torch's convention: called at the end of ``__init__``) runs it, and it covers
  its subtree; any other module constructs its children.
- **post-init** (``transformers``): each ``PreTrainedModel``, once its children are constructed, runs
  ``initialize_weights``'s walk over its subtree (children first, each sub-model its own
  ``_initialize_weights``, modules a sub-model initialised skipped), as its ``post_init`` does; this
  also recomputes buffers computed at init (rotary ``inv_freq``, BERT's ``position_ids``).

Each initialiser runs on the meta model itself under a dispatch mode that gives every meta tensor
it touches a real twin (on CPU, so the draws are the CPU build's), and factories that ask for
the meta device (``torch.arange(..., device=self.cos.device)`` in a buffer's initialiser) build
on CPU: the twin starts as NaN (zero for integer tensors), the initialiser writes it, and when the module is done each twin the rank
holds is cut into the rank's piece and dropped; elements left NaN keep the earlier value, so a
parent that rewrites part of a child's weight composes. A tensor tied under two names takes the
value its first name's module wrote, as ``tie_weights`` leaves it. A piece still NaN at the end was
never initialised: autopar refuses, naming the tensor and its module.

Every rank replays the same stream from the same seed, so dp replicas and tp shards agree; the
caller's random state is left as it was. The replay draws the whole model's random numbers on
every rank (time, not memory).
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree

from autopar.errors import PlanError
from autopar.runtime.checkpoints.checkpoint_layout import split
from autopar.runtime.state.materialize import Filler, Slot

__all__ = ["init_filler"]

log = logging.getLogger(__name__)


class _Twins(TorchDispatchMode):
    """Runs every op on real CPU twins of the meta tensors it touches; in-place results stay meta."""

    def __init__(self):
        super().__init__()
        self.twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, twin)
        self.live_bytes = 0
        self.peak_bytes = 0  # the most twin storage alive at once: one module's tensors

    def twin(self, t: torch.Tensor) -> torch.Tensor:
        entry = self.twins.get(id(t))
        if entry is None:
            fresh = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            fresh.fill_(float("nan") if fresh.is_floating_point() or fresh.is_complex() else 0)
            entry = self.twins[id(t)] = (t, fresh)
            self.live_bytes += fresh.numel() * fresh.element_size()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        metas = {}

        def real(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                twin = self.twin(x)
                metas[id(twin)] = x
                return twin
            return x

        if _on_meta(kwargs.get("device")):  # a factory (arange, zeros, ...) asked for meta: make it real too
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs))
        return pytree.tree_map(lambda o: metas.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        done, self.twins, self.live_bytes = list(self.twins.values()), {}, 0
        return done


def _on_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _tensor_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return names


class _Replay:
    """The state of one replay: what the rank keeps, the pieces so far, the module running."""

    def __init__(self, model: nn.Module, slots: list[Slot]):
        self.model = model
        self.names = _tensor_names(model)  # id -> names, first is the tensor's own (tie source)
        self.by_name = {}
        for slot in slots:
            for alias in slot.aliases:
                self.by_name[alias] = slot
        self.pieces: dict[str, torch.Tensor] = {}
        self.writer: dict[str, str] = {}  # slot name -> module whose initialiser wrote it last
        self.mode = _Twins()

    @contextlib.contextmanager
    def module(self, path: str, module: nn.Module):
        """Run one module's initialiser; then keep the rank's pieces of what it wrote."""
        local = _tensor_names(module)
        with torch.no_grad(), self.mode:
            yield
        for meta, twin in self.mode.take():
            own = self.names.get(id(meta))
            if not own:
                continue
            first = own[0]
            reached = [f"{path}.{n}" if path else n for n in local.get(id(meta), [])]
            if reached and first not in reached:
                continue  # written through a tied name: tie_weights keeps the first name's value
            slot = self.by_name.get(first)
            if slot is None:
                continue
            piece = split(twin, slot.layout, tp_index=slot.tp_index, z_index=slot.z_index, ep_index=slot.ep_index)
            old = self.pieces.get(slot.name)
            if old is not None and piece.is_floating_point():
                piece = torch.where(torch.isnan(piece), old, piece)
            self.pieces[slot.name] = piece
            self.writer[slot.name] = path or type(self.model).__name__


def _hf():
    try:
        from transformers import PreTrainedModel
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # pragma: no cover - transformers is optional
        return None, None
    return PreTrainedModel, guard_torch_init_functions


def _construct(replay: _Replay, module: nn.Module, path: str, hf) -> None:
    """Replay ``module``'s construction: its own ``reset_parameters`` (covering its subtree), else its
    children in order; a ``transformers`` model then runs its ``post_init`` over its subtree."""
    pretrained, _ = hf
    is_hf = pretrained is not None and isinstance(module, pretrained)
    reset = None if is_hf else (getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None))
    if callable(reset):
        with replay.module(path, module):
            reset()
    else:
        for name, child in module.named_children():
            _construct(replay, child, f"{path}.{name}" if path else name, hf)
    if is_hf:
        _post_init(replay, module, path, hf)


def _post_init(replay: _Replay, model: nn.Module, path: str, hf) -> None:
    """``PreTrainedModel.initialize_weights``'s walk, children first, each sub-model its own initialiser;
    modules a sub-model initialised already (``_is_hf_initialized``) are skipped, as in the library."""
    pretrained, guard = hf
    custom = bool(getattr(model, "is_custom_code", lambda: False)())

    def walk(module: nn.Module, where: str, init) -> None:
        for name, child in module.named_children():
            sub = f"{where}.{name}" if where else name
            walk(child, sub, child._initialize_weights if isinstance(child, pretrained) else init)
        with replay.module(where, module):
            init(module, custom)

    with guard():
        walk(model, path, model._initialize_weights)


def _replay_all(replay: _Replay) -> None:
    hf = _hf()
    root = replay.model
    flagged = {id(m) for m in root.modules() if getattr(m, "_is_hf_initialized", False)}
    try:
        _construct(replay, root, "", hf)
    finally:  # the flags belong to this replay, not to the user's model
        for m in root.modules():
            if id(m) not in flagged and "_is_hf_initialized" in vars(m):
                del m._is_hf_initialized


def _check_all(replay: _Replay, slots: list[Slot]) -> None:
    for slot in slots:
        piece = replay.pieces.get(slot.name)
        if piece is None or (piece.is_floating_point() and bool(torch.isnan(piece).any())):
            module = slot.name.rpartition(".")[0] or type(replay.model).__name__
            raise PlanError(
                f"{slot.name} of the meta-built model is not set by any initialiser of the model "
                f"(last written by {replay.writer.get(slot.name, 'none')})",
                where=f"module {module}",
                fix=f"give module {module} a reset_parameters() that sets {slot.name.rpartition('.')[2]}, "
                    "load pretrained weights into the model, or build it on a real device")


def init_filler(model: nn.Module, *, seed: int) -> Filler:
    """A filler drawing the rank's pieces with ``model``'s own initialisers from ``seed``.

    After a call, ``fill.peak_bytes`` is the most full-size (twin) storage that was alive at once.
    """

    def fill(slots: list[Slot]) -> dict[str, torch.Tensor]:
        replay = _Replay(model, slots)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            _replay_all(replay)
        _check_all(replay, slots)
        fill.peak_bytes = replay.mode.peak_bytes
        log.info("initialisers replayed: at most %.1f MB of full-size tensors alive at once", fill.peak_bytes / 1e6)
        return {s.name: replay.pieces[s.name] for s in slots}

    fill.peak_bytes = 0
    return fill
