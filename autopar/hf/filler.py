"""Pretrained weights straight into a meta-built model: a filler for ``autopar.compile(..., weights=)``.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    program = autopar.compile(model, mesh, example_inputs=..., weights=pretrained_weights(folder, model))

Each rank then allocates and reads only the pieces it holds (its stages, its tensor-parallel shard,
its ZeRO-3 block, its own experts of a mixture-of-experts layer split over ep) with safetensors
slicing (:func:`autopar.hf.load.read_piece`); no rank ever holds the whole model, and nothing is
initialised twice. What a checkpoint does not carry (buffers the model computes at construction and
does not save, such as rotary ``inv_freq``) is drawn by the model's own initialisers
(:func:`autopar.runtime.execution.init_replay.init_filler`), which replay every module's initialiser once on
that rank: for a very large model that costs time, never memory.

The checkpoint is checked against the whole model when the filler is made, the same way on every
rank: every persistent tensor needs a name in the folder (a tied weight one of its names), every
name in the folder must be the model's (or one the library ignores), and every shape must match.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from autopar.errors import CheckpointError
from autopar.hf.folder import PretrainedFolder
from autopar.hf.load import read_piece
from autopar.hf.names import checkpoint_to_program, find_hf_model, ignored_on_load
from autopar.runtime.execution.init_replay import init_filler
from autopar.runtime.state.materialize import Filler, Slot

__all__ = ["pretrained_weights"]

log = logging.getLogger(__name__)
_WHERE = "autopar.hf.pretrained_weights"


def _tie_groups(model: nn.Module) -> list[list[str]]:
    """The model's persistent state, one list of names per tensor (tied weights share a tensor)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _check_fit(model: nn.Module, folder: PretrainedFolder, to_model: dict[str, str]) -> None:
    by_model = {k: c for c, k in to_model.items()}
    shapes = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
    missing = [g[0] for g in _tie_groups(model) if not any(n in by_model for n in g)]
    wrong = [f"{c}: checkpoint {folder.shapes[c]} vs model {shapes[k]}" for c, k in to_model.items()
             if tuple(folder.shapes[c]) != shapes[k]]
    found = find_hf_model(model)
    unmapped = [c for c in folder.shapes if c not in to_model]
    unexpected = sorted(set(unmapped) - ignored_on_load(found[1] if found else None, unmapped))
    parts = [f"{label}: {names[:6]}" + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
             for label, names in (("missing from the checkpoint", missing), ("not in the model", unexpected),
                                  ("shape mismatches", wrong)) if names]
    if parts:
        raise CheckpointError(f"the checkpoint does not fit this model ({type(model).__name__}): " + "; ".join(parts),
                              where=f"{_WHERE}({folder.path!r})",
                              fix="build the model from the folder's own config "
                                  "(AutoConfig.from_pretrained(folder)) under torch.device('meta')")


def pretrained_weights(folder: str, model: nn.Module) -> Filler:
    """A filler reading each rank's pieces of ``model``'s tensors from the Hugging Face ``folder``."""
    ckpt = PretrainedFolder(folder)
    to_model = checkpoint_to_program(list(ckpt.shapes), model.state_dict(keep_vars=True).keys())
    _check_fit(model, ckpt, to_model)
    by_model = {k: c for c, k in to_model.items()}
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
        n for n, _ in model.named_buffers(remove_duplicate=False)}

    def fill(slots: list[Slot]) -> dict[str, torch.Tensor]:
        strangers = [s.name for s in slots if not set(s.aliases) & known]
        if strangers:
            raise CheckpointError(f"the filler was made for {type(model).__name__}, but the compiled model holds "
                                  f"{strangers[:3]}, which it does not", where=f"{_WHERE}({ckpt.path!r}, model)",
                                  fix="pass the very module you compile (a wrapper included) to pretrained_weights")
        pieces, rest = {}, []
        for slot in slots:
            key = next((by_model[a] for a in slot.aliases if a in by_model), None)
            if key is None:
                rest.append(slot)  # not saved (a buffer computed at construction)
                continue
            pieces[slot.name] = read_piece(ckpt, key, slot.layout, tp_index=slot.tp_index, z_index=slot.z_index,
                                           dtype=slot.dtype, ep_index=slot.ep_index)
        if rest:
            log.info("%d tensors are not in %s (%s...): drawn by the model's initialisers", len(rest), ckpt.path,
                     rest[0].name)
            pieces.update(init_filler(model, seed=torch.initial_seed())(rest))
        fill.elements_read = ckpt.elements_read
        return pieces

    fill.elements_read = 0
    return fill
