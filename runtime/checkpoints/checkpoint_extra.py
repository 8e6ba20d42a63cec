"""What a checkpoint carries besides the model: a learning-rate scheduler, a data loader's position, ...

``program.save_checkpoint(root, extra={"scheduler": scheduler})`` saves ``obj.state_dict()`` of each
object under its name, and ``program.load_checkpoint(path, extra={"scheduler": scheduler})`` gives
each object back its state with ``obj.load_state_dict(state)``, on any mesh: a resumed run goes on
with the schedule of the run that stopped (its learning rates come back with the optimizer's
groups: :mod:`autopar.runtime.checkpoints.checkpoint`).

- The states are global rank 0's, written by it into ``extra.pt`` of the step folder (``torch.save``)
  before the folder is published, with the file's CRC-32 and the names in the manifest. An object
  whose state differs between ranks (a per-rank data position) must be saved by the user per rank.
- A load first checks that the checkpoint holds every name asked for and that the file is intact
  (a :class:`~autopar.errors.CheckpointError` on every rank, before anything changes), and gives
  the states back after the weights and the optimizer. Names saved but not asked for are left.
- The file is read with ``torch.load(weights_only=False)``: torch's schedulers keep Python objects
  (``MultiStepLR``'s ``Counter``) that the restricted loader refuses, and a checkpoint is trusted as
  DCP's own pickled index is.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Mapping

import torch

from autopar.errors import CheckpointError

__all__ = ["EXTRA_FILE", "check_extra", "write_extra", "read_extra", "restore_extra"]

EXTRA_FILE = "extra.pt"


def check_extra(extra, *, where: str) -> dict:
    """``extra`` as a dict of str -> object with ``state_dict`` and ``load_state_dict`` (None: empty)."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a mapping of names to objects with state_dict(), got "
                              f"{type(extra).__name__}", where=where, fix="pass extra={'scheduler': scheduler}")
    for name, obj in extra.items():
        if not isinstance(name, str) or not (callable(getattr(obj, "state_dict", None))
                                             and callable(getattr(obj, "load_state_dict", None))):
            raise CheckpointError(f"extra[{name!r}] is a {type(obj).__name__}, which lacks state_dict() and "
                                  "load_state_dict()", where=where,
                                  fix="pass objects such as a torch.optim.lr_scheduler scheduler, keyed by a str")
    return dict(extra)


def _crc(path: str) -> int:
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def write_extra(folder: str, extra: dict) -> dict | None:
    """Save every object's state into ``folder`` (rank 0); the manifest's entry, or None when there is none."""
    if not extra:
        return None
    path = os.path.join(folder, EXTRA_FILE)
    with open(path, "wb") as f:
        torch.save({name: obj.state_dict() for name, obj in extra.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    return {"names": sorted(extra), "checksum": _crc(path)}


def read_extra(folder: str, manifest: dict, extra: dict) -> tuple[dict, CheckpointError | None]:
    """The saved states of the names in ``extra`` ({} and an error when one is missing or the file is damaged)."""
    if not extra:
        return {}, None
    entry = manifest.get("extra") or {"names": []}
    missing = sorted(set(extra) - set(entry["names"]))
    if missing:
        return {}, CheckpointError(f"the checkpoint holds no state for {missing} (it holds {entry['names']})",
                                   where=f"load_checkpoint(extra=...), {folder}",
                                   fix="save with program.save_checkpoint(root, extra={...}) under the same names, "
                                       "or drop them from extra")
    path = os.path.join(folder, EXTRA_FILE)
    try:
        if _crc(path) != entry["checksum"]:
            raise ValueError(f"{EXTRA_FILE} does not match the checksum the manifest recorded")
        with open(path, "rb") as f:
            states = torch.load(f, weights_only=False)  # trusted as DCP's pickled index (module doc)
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        return {}, CheckpointError(f"the extra states are corrupted or missing: {type(exc).__name__}: {exc}",
                                   where=folder, fix="load an earlier checkpoint (the root's other step_… folders)")
    return {name: states[name] for name in extra}, None


def restore_extra(extra: dict, states: dict) -> None:
    """Give every object its saved state."""
    for name, obj in extra.items():
        obj.load_state_dict(states[name])
