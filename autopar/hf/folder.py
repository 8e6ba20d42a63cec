"""A Hugging Face checkpoint folder on disk: which file holds each tensor, its shape, and slice reads.

A folder holds either one ``model.safetensors`` or a ``model.safetensors.index.json`` whose
``weight_map`` names the file of every tensor (``model-00001-of-00003.safetensors`` ...), as
``transformers``' ``save_pretrained`` writes them. Only the files' headers are read here; a tensor's
bytes are read by :meth:`PretrainedFolder.read`, one rectangle at a time, through safetensors'
``safe_open(...).get_slice(name)[...]``. The file is opened for one tensor and closed after it:
safetensors maps the file into memory, and its pages count towards the reader's resident memory
until the mapping goes, so a rank's peak stays its own pieces plus the pages of one tensor.

Example::

    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> folder = tempfile.mkdtemp()
    >>> save_file({"w": torch.arange(12.).view(3, 4)}, folder + "/model.safetensors")
    >>> f = PretrainedFolder(folder)
    >>> f.shapes["w"]
    (3, 4)
    >>> f.read("w", [[(1, 3)], [(0, 1), (3, 4)]]).tolist()
    [[4.0, 7.0], [8.0, 11.0]]
"""
from __future__ import annotations

import json
import os

import torch

from autopar.errors import CheckpointError

__all__ = ["PretrainedFolder", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WHERE = "autopar.hf.load_pretrained"
_FIX_FOLDER = ("pass the local folder that holds config.json and model.safetensors (or its sharded index), "
               "e.g. one written by transformers' save_pretrained or fetched with huggingface_hub's snapshot_download")


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CheckpointError("reading Hugging Face checkpoints needs the `safetensors` package", where=_WHERE,
                              fix="pip install 'autopar[models]' (or pip install safetensors)") from exc
    return safe_open


class PretrainedFolder:
    """The tensors of one checkpoint folder: ``files[name]`` (path), ``shapes[name]``; ``elements_read``
    counts the elements :meth:`read` took from the files."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.elements_read = 0
        if not os.path.isdir(self.path):
            what = "is a file, not a folder" if os.path.exists(self.path) else "does not exist"
            raise CheckpointError(f"the checkpoint folder {self.path!r} {what}", where=_WHERE, fix=_FIX_FOLDER)
        self.files = self._weight_map()
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            self._read_header(file)
        absent = sorted(n for n, f in self.files.items() if n not in self.shapes)
        if absent:
            raise CheckpointError(f"{INDEX_FILE} lists {len(absent)} tensor(s) that its files do not hold, "
                                  f"e.g. {absent[:4]}", where=self.path,
                                  fix="the download or the save was incomplete: fetch or write the folder again")

    def _weight_map(self) -> dict[str, str]:
        """{tensor name: file path}, from the index or the single file."""
        index = os.path.join(self.path, INDEX_FILE)
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                return {name: os.path.join(self.path, file) for name, file in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"the index {index} is unreadable: {type(exc).__name__}: {exc}", where=self.path,
                                      fix="fetch or write the folder again") from exc
        if os.path.isfile(single):
            return {name: single for name in self._keys(single)}
        present = sorted(os.listdir(self.path))
        pickles = [p for p in present if p.endswith((".bin", ".pt", ".pth"))]
        what = f"{self.path!r} holds no {SINGLE_FILE} and no {INDEX_FILE} (it holds {present[:8]})"
        fix = _FIX_FOLDER
        if pickles:
            fix = (f"{pickles[0]} is a pickle, which autopar does not read: convert the folder once with "
                   "transformers (AutoModel*.from_pretrained(folder).save_pretrained(new_folder) writes safetensors)")
        raise CheckpointError(what, where=_WHERE, fix=fix)

    def _keys(self, file: str) -> list[str]:
        safe_open = _safetensors()
        try:
            with safe_open(file, framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors on a damaged or missing file
            raise CheckpointError(f"{file} is not a readable safetensors file: {type(exc).__name__}: {exc}",
                                  where=self.path, fix="fetch or write the folder again") from exc

    def _read_header(self, file: str) -> None:
        safe_open = _safetensors()
        wanted = {n for n, f in self.files.items() if f == file}
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in wanted:
                        self.shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as exc:  # noqa: BLE001 - a missing shard or a damaged header
            raise CheckpointError(f"{file} is not a readable safetensors file: {type(exc).__name__}: {exc}",
                                  where=self.path, fix="fetch or write the folder again") from exc

    def read(self, name: str, runs: list[list[tuple[int, int]]], *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor ``name`` restricted, on each dim, to the concatenation of that dim's ``runs``
        (``(start, stop)`` index ranges); a fresh tensor (no view into the file), cast to ``dtype``."""
        safe_open = _safetensors()
        try:
            with safe_open(self.files[name], framework="pt") as f:
                if not runs:  # a 0-dim tensor
                    view = f.get_tensor(name)
                    out = view.to(dtype or view.dtype, copy=True)
                else:
                    sl = f.get_slice(name)
                    out = _read_runs(sl, runs, dtype)
                    del sl
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged data section
            raise CheckpointError(f"reading {name} from {self.files[name]} failed: {type(exc).__name__}: {exc}",
                                  where=self.path, fix="fetch or write the folder again") from exc
        self.elements_read += out.numel()
        return out


def _read_runs(sl, runs: list[list[tuple[int, int]]], dtype: torch.dtype | None) -> torch.Tensor:
    """Concatenate the rectangles of ``runs`` (at most a few dims have more than one run)."""
    multi = next((d for d, r in enumerate(runs) if len(r) > 1), None)
    if multi is None:
        view = sl[tuple(slice(a, b) for (a, b), in runs)]
        return view.to(dtype or view.dtype, copy=True)  # a copy: the view holds the file's mapping
    parts = [_read_runs(sl, runs[:multi] + [[run]] + runs[multi + 1:], dtype) for run in runs[multi]]
    return torch.cat(parts, dim=multi)
