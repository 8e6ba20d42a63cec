"""Weights out: a folder that ``transformers``' ``AutoModel*.from_pretrained`` loads, from any mesh.

``save_pretrained(program, folder)`` writes ``config.json`` (and ``generation_config.json`` for
generative models) and the weights under the library's names: ``model.safetensors``, or above
``max_shard_size`` the files ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``,
the layout ``save_pretrained`` itself writes. A tied weight is written once, under the name the
library keeps (``model.embed_tokens.weight``, not ``lm_head.weight``).

The gather streams: file by file, every rank sends rank 0 the pieces it holds of that file's
tensors (dp index 0, or every dp index for ZeRO-3 blocks; tp index 0 of a replicated tensor), and
rank 0 joins them (:func:`autopar.runtime.checkpoints.checkpoint_layout.join`) and writes the file, so rank 0
holds one file's tensors at a time and the others only their own pieces. Rank 0 writes into a
temporary folder beside ``folder``, fsyncs every file and the folder, and renames it into place.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import re
import shutil

import torch
import torch.distributed as dist

from autopar.errors import CheckpointError
from autopar.hf.folder import INDEX_FILE, SINGLE_FILE
from autopar.hf.names import find_hf_model, library_class, tied_targets
from autopar.runtime.checkpoints.checkpoint import agree_on_error
from autopar.runtime.checkpoints.checkpoint_layout import Layout, join
from autopar.runtime.checkpoints.checkpoint_files import fsync_path
from autopar.runtime.state.rank_tensors import held_tensors

__all__ = ["save_pretrained", "parse_size"]

log = logging.getLogger(__name__)
_WHERE = "autopar.hf.save_pretrained"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` (10^9, as transformers reads it), ``500MiB`` (2^20) or an int.

    >>> parse_size("5GB"), parse_size("2KiB"), parse_size(1000)
    (5000000000, 2048, 1000)
    """
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size={size!r} is not a size", where=_WHERE,
                              fix="pass a positive number of bytes or a string such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _gather_to_root(obj) -> list | None:
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _tensors(program, held) -> dict[str, dict]:
    """{canonical name: {layout, dtype, aliases}} of every tensor of the model (from every rank)."""
    mine = {h.name: {"layout": h.layout.to_json(), "dtype": str(h.tensor.dtype).removeprefix("torch."),
                     "aliases": list(h.aliases)} for h in held}
    merged: dict = {}
    for part in _all_gather(mine):
        merged.update(part)
    return merged


def _library_names(program, tensors: dict, prefix: str, hf_model) -> tuple[dict[str, str], CheckpointError | None]:
    """{canonical name: library name} in the model's state_dict order, tied weights once."""
    order = {k: i for i, k in enumerate(program.state_keys)}
    dropped = tied_targets(hf_model) | set(getattr(hf_model, "_keys_to_ignore_on_save", None) or [])
    names, outside = {}, []
    for name in sorted(tensors, key=lambda n: min(order.get(a, len(order)) for a in tensors[n]["aliases"])):
        aliases = sorted(tensors[name]["aliases"], key=lambda a: order.get(a, len(order)))
        inside = [a[len(prefix):] for a in aliases if a.startswith(prefix)]
        if not inside:
            outside.append(aliases[0])
            continue
        kept = [a for a in inside if a not in dropped]
        names[name] = (kept or inside)[0]
    if not outside:
        return names, None
    return names, CheckpointError(f"{len(outside)} weight(s) are outside the transformers model "
                                  f"({prefix.rstrip('.') or 'the model'}): {outside[:6]}", where=_WHERE,
                                  fix="a Hugging Face folder holds the library model's weights only: save the "
                                      "others with program.full_state_dict(), or move them into the library model")


def _files(names: dict[str, str], tensors: dict, dtype, limit: int) -> list[list[str]]:
    """The canonical names of each output file, in order, each file at most ``limit`` bytes (a bigger
    tensor gets a file of its own)."""
    files, current, size = [], [], 0
    for name in names:
        t = tensors[name]
        nbytes = math.prod(t["layout"]["shape"]) * (dtype or getattr(torch, t["dtype"])).itemsize
        if current and size + nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return files + [current] if current else files


def _my_pieces(program, held, wanted: set[str]) -> dict[str, torch.Tensor]:
    """This rank's pieces of ``wanted``: the dp index 0 copy (every ZeRO-3 block; the dp index of each ep block of
    an expert tensor), tp index 0 of a replica."""
    coords, out = program.info.coords, {}
    for h in held:
        first = h.ep_index if h.layout.ep else 0  # dp index ep_index holds the first copy of ep block ep_index
        if h.name not in wanted or (coords["dp"] != first and not h.layout.z3) \
                or (coords["tp"] != 0 and not h.layout.tp):
            continue
        out[h.piece(h.name)] = h.tensor.detach().cpu()
    return out


def _prepare(folder: str, overwrite: bool) -> tuple[str | None, CheckpointError | None]:
    """Rank 0: the temporary folder beside ``folder`` (made empty), or why ``folder`` cannot be written."""
    folder = os.path.abspath(folder)
    if os.path.exists(folder) and (not os.path.isdir(folder) or (os.listdir(folder) and not overwrite)):
        what = "is a file" if not os.path.isdir(folder) else "exists and is not empty"
        return None, CheckpointError(f"{folder!r} {what}", where=_WHERE,
                                     fix="pass a new folder, or overwrite=True to replace the folder as a whole")
    tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as exc:
        return None, CheckpointError(f"cannot write beside {folder!r}: {exc}", where=_WHERE,
                                     fix="check the disk (space, permissions)")
    return tmp, None


def _write_metadata(tmp: str, config, hf_model, dtype_name: str) -> None:
    config = copy.deepcopy(config)
    if hf_model is not None:
        config.architectures = [library_class(hf_model).__name__]
    config.dtype = dtype_name
    config.save_pretrained(tmp)
    generation = getattr(hf_model, "generation_config", None)
    if generation is not None and hasattr(hf_model, "can_generate") and hf_model.can_generate():
        generation.save_pretrained(tmp)


def _publish(tmp: str, folder: str) -> None:
    """Fsync ``tmp``'s files and itself, rename it to ``folder`` (replacing an old one), fsync the parent."""
    for name in os.listdir(tmp):
        fsync_path(os.path.join(tmp, name))
    fsync_path(tmp)
    folder = os.path.abspath(folder)
    old = None
    if os.path.exists(folder):
        old = f"{os.path.join(os.path.dirname(folder), '.' + os.path.basename(folder))}.old-{os.getpid()}"
        os.rename(folder, old)
    os.rename(tmp, folder)
    fsync_path(os.path.dirname(folder))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_file(tmp: str, file: str, parts: list[dict], members: list[str], names: dict[str, str], tensors: dict,
                dtype) -> int:
    """Rank 0: join the gathered pieces of one file's tensors and write it; its bytes."""
    from safetensors.torch import save_file
    pieces: dict[str, torch.Tensor] = {}
    for part in parts:
        pieces.update(part)
    out = {}
    for name in members:
        layout = Layout.from_json(tensors[name]["layout"])
        full = join(pieces, layout, name)
        out[names[name]] = full.to(dtype or full.dtype).contiguous()
    save_file(out, os.path.join(tmp, file), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in out.values())


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def save_pretrained(program, folder: str, *, config=None, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> str:
    """Write ``program``'s weights as a Hugging Face folder; collective (every rank calls it, rank 0
    writes). ``config`` defaults to the config of the transformers model inside the program's model;
    ``dtype`` casts the weights (default: the program's, the fp32 masters under bf16). Returns the folder."""
    import json
    rank, _ = _world()
    limit = parse_size(max_shard_size)
    found = find_hf_model(getattr(program, "compile_args", {}).get("model"))
    prefix, hf_model = found if found else ("", None)
    config = config if config is not None else getattr(hf_model, "config", None)
    error = None
    if config is None:
        error = CheckpointError("the program's model holds no transformers model, and no config was given",
                                where=_WHERE, fix="pass config= (the model's transformers PretrainedConfig)")
    agree_on_error(error)
    held = held_tensors(program)
    tensors = _tensors(program, held)
    names, error = _library_names(program, tensors, prefix, hf_model)
    agree_on_error(error)
    tmp = None
    if rank == 0:
        tmp, error = _prepare(folder, overwrite)
    agree_on_error(error)
    files = _files(names, tensors, dtype, limit)
    file_names, weight_map, total = _file_names(len(files)), {}, 0
    for file, members in zip(file_names, files):
        parts = _gather_to_root(_my_pieces(program, held, set(members)))
        if rank == 0 and error is None:
            try:
                total += _write_file(tmp, file, parts, members, names, tensors, dtype)
                weight_map.update({names[n]: file for n in members})
            except Exception as exc:  # noqa: BLE001 - the disk: rank 0 goes on gathering so nobody waits
                error = CheckpointError(f"writing {file} failed: {type(exc).__name__}: {exc}", where=tmp,
                                        fix="check the disk (space, permissions); nothing was published")
        del parts
    if rank == 0 and error is None:
        try:
            if len(files) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                    json.dump(index, f, indent=2, sort_keys=True)
            out_dtype = dtype or getattr(torch, next(iter(tensors.values()))["dtype"])
            _write_metadata(tmp, config, hf_model, str(out_dtype).removeprefix("torch."))
            _publish(tmp, folder)
        except Exception as exc:  # noqa: BLE001
            error = CheckpointError(f"publishing {folder!r} failed: {type(exc).__name__}: {exc}", where=tmp,
                                    fix="check the disk (space, permissions); the folder was not replaced")
    if rank == 0 and error is not None and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    agree_on_error(error)
    if rank == 0:
        log.info("saved %d tensors in %d file(s) to %s", len(names), len(files), folder)
    return os.path.abspath(folder)
