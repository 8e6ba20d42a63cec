"""Pretrained weights in: each rank reads its own pieces of a Hugging Face checkpoint folder.

``load_pretrained(program, folder)`` sets the weights (and persistent buffers) of a compiled
program from a local ``transformers`` checkpoint. Every rank reads, for each tensor it holds
(:func:`autopar.runtime.state.rank_tensors.held_tensors`: only its stages, its tensor-parallel shard,
its ZeRO-3 block, its experts of a tensor split over ep), just those index ranges of the file, with
safetensors slicing: a fused projection's tp shard is one range per block on the sharded dim, a ZeRO-3
block the rows that hold its flat range, an ep rank's experts their range of dim 0. Nothing is
asked of the model's own weights: the program's tensors are filled, so a model whose program was
built without materialising the whole model loads the same way.

Checks before anything changes, on every rank together: the folder exists and is readable, every
tensor the program holds has a checkpoint name (a tied weight needs one of its names), every
checkpoint name is the program's (or one the library ignores), and every shape is the model's.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.errors import CheckpointError
from autopar.hf.folder import PretrainedFolder
from autopar.hf.names import checkpoint_to_program, find_hf_model, ignored_on_load
from autopar.ir.shard_layout import EXPERTS, ZERO3
from autopar.runtime.checkpoints.checkpoint import agree_on_error
from autopar.runtime.checkpoints.checkpoint_layout import Layout
from autopar.runtime.state.rank_tensors import Held, held_tensors

__all__ = ["load_pretrained", "LoadReport", "piece_runs", "read_piece"]

log = logging.getLogger(__name__)
_WHERE = "autopar.hf.load_pretrained"


@dataclass(frozen=True)
class LoadReport:
    """What this rank read: tensors set, elements read from the files (its pieces; a ZeRO-3 block's
    whole rows), of how many the files hold."""

    num_tensors: int
    elements_read: int
    checkpoint_elements: int


def piece_runs(layout: Layout, *, tp_index: int, ep_index: int = 0) -> list[list[tuple[int, int]]]:
    """Per dim of the logical tensor, the index ranges whose concatenation is tp shard ``tp_index``
    (as its :class:`~autopar.ir.shard_layout.ShardLayout` cuts it) of ep block ``ep_index`` (an
    expert tensor split over ep ranks: its experts' rows of dim 0, then the tp cut inside them)."""
    block_shape = layout.ep_local_shape()
    runs = [[(0, n)] for n in block_shape]
    if layout.tp:
        runs = layout.tp.ranges(block_shape, rank=layout.tp_rank(tp_index), size=layout.tp_size)
    if layout.ep:  # the ep block's rows of dim 0: ranges inside the block, moved to where the block starts
        (offset, _), = EXPERTS.ranges(layout.shape, rank=ep_index, size=layout.ep)[0]
        runs[0] = [(start + offset, stop + offset) for start, stop in runs[0]]
    return runs


def _rows(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``runs`` (concatenated) restricted to their rows ``lo:hi``."""
    out, offset = [], 0
    for start, stop in runs:
        a, b = max(lo, offset), min(hi, offset + stop - start)
        if a < b:
            out.append((start + a - offset, start + b - offset))
        offset += stop - start
    return out


def read_piece(folder: PretrainedFolder, name: str, layout: Layout, *, tp_index: int, z_index: int,
               dtype: torch.dtype, ep_index: int = 0) -> torch.Tensor:
    """The piece of checkpoint tensor ``name`` that rank (ep_index, tp_index, z_index) holds under ``layout``;
    equal to :func:`autopar.runtime.checkpoints.checkpoint_layout.split` of the whole tensor, reading only the piece."""
    runs = piece_runs(layout, tp_index=tp_index, ep_index=ep_index)
    if not layout.z3:
        return folder.read(name, runs, dtype=dtype)
    local = layout.tp_local_shape()
    numel, block = math.prod(local), layout.piece_shape()[0]
    (start, stop), = ZERO3.ranges((numel,), rank=z_index, size=layout.z3)[0]  # the flat range, padding left out
    out = torch.zeros(block, dtype=dtype)
    if start >= stop:  # a block of padding only
        return out
    if not local:
        out[0] = folder.read(name, [], dtype=dtype)
        return out
    row = math.prod(local[1:])
    first, last = start // row, -(-stop // row)
    runs[0] = _rows(runs[0], first, last)
    data = folder.read(name, runs, dtype=dtype).reshape(-1)
    out[:stop - start] = data[start - first * row: stop - first * row]
    return out


def _problems(program, held: list[Held], folder: PretrainedFolder, to_program: dict[str, str]) -> dict:
    """This rank's findings: missing names, shape mismatches; and (the same on every rank) unexpected names."""
    by_program = {k: c for c, k in to_program.items()}
    missing, wrong = [], []
    for h in held:
        key = next((by_program[a] for a in h.aliases if a in by_program), None)
        if key is None:
            missing.append(h.name)
        elif folder.shapes[key] != h.layout.shape:
            wrong.append(f"{key}: checkpoint {folder.shapes[key]} vs model {h.layout.shape}")
    found = find_hf_model(getattr(program, "compile_args", {}).get("model"))
    unmapped = [c for c in folder.shapes if c not in to_program]
    unexpected = sorted(set(unmapped) - ignored_on_load(found[1] if found else None, unmapped))
    return {"missing": missing, "wrong": wrong, "unexpected": unexpected}


def _union(mine: dict) -> dict:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: sorted({x for part in every for x in part[k]}) for k in mine}


def _fit_error(problems: dict, folder: PretrainedFolder, model_name: str) -> CheckpointError | None:
    parts = []
    for key, label in (("missing", "missing from the checkpoint"), ("unexpected", "not in the model"),
                       ("wrong", "shape mismatches")):
        names = problems[key]
        if names:
            parts.append(f"{label}: {names[:6]}" + (f" (+{len(names) - 6} more)" if len(names) > 6 else ""))
    if not parts:
        return None
    return CheckpointError(f"the checkpoint does not fit this model ({model_name}): " + "; ".join(parts),
                           where=f"{_WHERE}({folder.path!r})",
                           fix="load the checkpoint of the same architecture and configuration (build the model "
                               "from the folder's config.json: AutoConfig.from_pretrained(folder)); a folder in the "
                               "library's original format that transformers converts on load (per-expert MoE "
                               "weights) must be re-saved once in the model's own names: "
                               "AutoModel*.from_pretrained(folder).save_pretrained(new, save_original_format=False)")


def load_pretrained(program, folder: str) -> LoadReport:
    """Set ``program``'s weights from the checkpoint ``folder``; collective (every rank calls it).

    Returns what this rank read (:class:`LoadReport`). The optimizer's state is left as it is.
    """
    error, ckpt = None, None
    try:
        ckpt = PretrainedFolder(folder)
    except CheckpointError as exc:
        error = exc
    agree_on_error(error)
    held = held_tensors(program)
    to_program = checkpoint_to_program(list(ckpt.shapes), program.state_keys)
    agree_on_error(_fit_error(_union(_problems(program, held, ckpt, to_program)), ckpt, program.plan.model_name))
    by_program = {k: c for c, k in to_program.items()}
    try:
        with torch.no_grad():
            for h in held:
                key = next(by_program[a] for a in h.aliases if a in by_program)
                piece = read_piece(ckpt, key, h.layout, tp_index=h.tp_index, z_index=h.z_index, dtype=h.tensor.dtype,
                                   ep_index=h.ep_index)
                h.tensor.copy_(piece)
    except CheckpointError as exc:
        error = exc
    agree_on_error(error)
    if getattr(program, "mixed", None) is not None:  # round the masters into the bf16 copies; ZeRO owners broadcast
        program.optimizer.publish_parameters()
    report = LoadReport(num_tensors=len(held), elements_read=ckpt.elements_read,
                        checkpoint_elements=sum(math.prod(s) for s in ckpt.shapes.values()))
    log.info("rank %d: loaded %d tensors from %s (%d of the checkpoint's %d elements)", program.info.rank,
             report.num_tensors, ckpt.path, report.elements_read, report.checkpoint_elements)
    return report
