"""A checkpoint's files: the folder per step, the ``latest`` pointer, the manifest, atomic publish.

A checkpoint root holds one folder per saved step and a ``latest`` file naming the newest::

    root/
      latest                      "step_00000012"
      step_00000012/
        .metadata                 torch.distributed.checkpoint's index of every piece
        __0_0.distcp ...          the pieces, one file per writing rank
        autopar.json              the manifest: step, layouts, checksums, optimizer groups

A save writes into ``root/.tmp-step_…``, and only when every rank has written and the manifest is
complete does rank 0 rename the folder into place and then replace ``latest`` (both atomic
renames on a POSIX filesystem). A crash at any point before leaves ``latest`` on the previous
checkpoint, which stays loadable. Every rank must see the same filesystem (one machine, or a
shared mount across nodes).
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping

import torch
import torch.nn as nn

from autopar.errors import CheckpointError

__all__ = ["check_checkpoint_path", "check_state_dict", "fsync_path", "MANIFEST", "FORMAT", "step_dir_name",
           "tmp_dir_for", "resolve", "latest_step_dir", "publish", "read_manifest", "write_manifest", "checksum",
           "remove_quietly"]

MANIFEST = "autopar.json"
FORMAT = "autopar-checkpoint/1"
_LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def tmp_dir_for(root: str, step: int) -> str:
    return os.path.join(root, f".tmp-{step_dir_name(step)}")


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy().tobytes())


def fsync_path(path: str) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_step_dir(root: str) -> str | None:
    """The folder ``root/latest`` names, or None when there is no checkpoint under ``root`` yet."""
    pointer = os.path.join(root, _LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    return os.path.join(root, name) if name else None


def resolve(path: str) -> str:
    """A step folder from ``path``: the folder itself, or the one a root's ``latest`` names."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, ".metadata")):
        return path  # a step folder (read_manifest says so if its manifest is missing)
    latest = latest_step_dir(path)
    if latest is not None:
        return latest
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path!r}: it does not exist", where="load_checkpoint",
                              fix="pass the root folder given to save_checkpoint, or a step_… folder in it")
    raise CheckpointError(f"{path!r} holds no checkpoint (no {MANIFEST} and no '{_LATEST}' pointer)",
                          where="load_checkpoint",
                          fix="pass the root folder given to save_checkpoint, or a step_… folder in it")


def publish(tmp: str, root: str, step: int) -> str:
    """Rename the finished ``tmp`` folder to ``root/step_…`` and point ``latest`` at it (rank 0 only)."""
    final = os.path.join(root, step_dir_name(step))
    old = None
    if os.path.exists(final):  # saving the same step again: move the old one aside first
        old = final + ".old"
        remove_quietly(old)
        os.rename(final, old)
    os.rename(tmp, final)
    pointer_tmp = os.path.join(root, f".{_LATEST}.tmp")
    with open(pointer_tmp, "w") as f:
        f.write(step_dir_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, os.path.join(root, _LATEST))
    fsync_path(root)
    if old is not None:
        remove_quietly(old)
    return final


def remove_quietly(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_manifest(folder: str, manifest: dict) -> None:
    path = os.path.join(folder, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: str) -> dict:
    """The manifest of a step folder; CheckpointError if it is missing, unreadable or of another format."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing", where=folder,
                              fix="the checkpoint was not published completely; load an earlier checkpoint") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"the manifest {path} is corrupted: {exc}", where=folder,
                              fix="load an earlier checkpoint (the root's other step_… folders)") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an autopar checkpoint manifest ({FORMAT})", where=folder,
                              fix="load a checkpoint written by autopar's save_checkpoint")
    return manifest


# -- what a user hands to a load, checked before anything is read (autopar/validation.py re-exports) --
def _kind(value) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


def check_checkpoint_path(path) -> None:
    """A checkpoint path is a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint path must be a str or os.PathLike, got {_kind(path)}",
                              where="load_checkpoint(path=...)",
                              fix="pass the folder save_checkpoint wrote (its root, or one step folder)")


def check_state_dict(state_dict) -> None:
    """A single-device state_dict: a mapping of str -> tensor."""
    if isinstance(state_dict, nn.Module):
        raise CheckpointError(f"load_full_state_dict was given the module {type(state_dict).__name__}, not its "
                              "state_dict", where="load_full_state_dict(state_dict=...)",
                              fix="pass model.state_dict()")
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"a state_dict must be a mapping of str -> tensor, got {_kind(state_dict)}",
                              where="load_full_state_dict(state_dict=...)", fix="pass model.state_dict()")
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state_dict entry {key!r} is a {_kind(value)}, not a tensor keyed by name",
                                  where="load_full_state_dict(state_dict=...)",
                                  fix="pass model.state_dict() (or torch.load of a saved one)")
