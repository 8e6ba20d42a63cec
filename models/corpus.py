"""A small real text corpus, built from the docstrings the Python installation ships; no downloads.

:func:`corpus_text` imports a fixed list of pure-Python stdlib modules and joins the docstrings of
each module and of the classes, functions and methods it defines, sorted and deduplicated. It is
several hundred KB and builds in about a tenth of a second; nothing is cached, so every call
rebuilds it. The text differs a little between Python versions; :class:`CharTokenizer` has a fixed
vocabulary so token ids and ``vocab_size`` do not.

Example::

    >>> tok = CharTokenizer()
    >>> tok.decode(tok.encode("hello\\n"))
    'hello\\n'
    >>> inputs, targets = next(iter(TextBatches(seq_len=16, batch_size=4, seed=0)))
    >>> inputs.shape, bool((inputs[:, 1:] == targets[:, :-1]).all())
    (torch.Size([4, 16]), True)
"""
from __future__ import annotations

import importlib
import inspect
import logging
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["CORPUS_MODULES", "corpus_text", "CharTokenizer", "TextBatches", "lm_loss"]

logger = logging.getLogger(__name__)

#: The stdlib modules whose docstrings make the corpus: pure Python, no side effects on import.
CORPUS_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "gettext", "heapq", "http.client", "inspect", "ipaddress", "json", "logging",
    "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "zipfile",
)

_MIN_CORPUS_CHARS = 100_000


def _doc(obj: object) -> str | None:
    """The cleaned docstring of ``obj``, or None."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _module_docs(module: ModuleType) -> list[str]:
    """Docstrings of a module and of the classes, functions and methods defined in it."""
    docs = [_doc(module)]
    for _, obj in sorted(vars(module).items()):
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        docs.append(_doc(obj))
        if inspect.isclass(obj):
            for _, member in sorted(vars(obj).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) or isinstance(member, property):
                    docs.append(_doc(member))
    return [d for d in docs if d]


def corpus_text(*, modules: tuple[str, ...] = CORPUS_MODULES) -> str:
    """Docstrings of ``modules``, sorted, deduplicated, joined by blank lines; tabs expanded."""
    if sys.flags.optimize >= 2:
        raise RuntimeError(
            "the corpus is built from docstrings, which python -OO strips; run without -OO"
        )
    docs: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            docs.update(_module_docs(importlib.import_module(name)))
    text = "\n\n".join(sorted(docs)).expandtabs(4) + "\n"
    if len(text) < _MIN_CORPUS_CHARS:
        raise RuntimeError(f"corpus is only {len(text)} characters; pass more modules")
    logger.debug("corpus: %d docstrings, %d characters", len(docs), len(text))
    return text


class CharTokenizer:
    """Character-level tokenizer with a fixed vocabulary, independent of the text it encodes.

    Id 0 is ``<unk>`` (any character not listed), id 1 is newline, ids 2..96 are printable ASCII
    (space to ``~``). ``vocab_size`` is padded up to a multiple of ``pad_to_multiple_of`` (64 by
    default, giving 128) so embedding and head weights split evenly over tensor-parallel ranks;
    the padding ids never occur in encoded text and decode as ``<unk>``.
    """

    unk_id = 0
    unk_char = "\N{REPLACEMENT CHARACTER}"

    def __init__(self, *, pad_to_multiple_of: int = 64):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.chars: tuple[str, ...] = ("\n",) + tuple(chr(i) for i in range(32, 127))
        self._ids = {c: i + 1 for i, c in enumerate(self.chars)}
        used = len(self.chars) + 1
        self.vocab_size = -(-used // pad_to_multiple_of) * pad_to_multiple_of

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character; unknown characters become ``unk_id``."""
        ids = self._ids
        return [ids.get(c, self.unk_id) for c in text]

    def encode_tensor(self, text: str) -> torch.Tensor:
        """:meth:`encode` as a 1-D LongTensor."""
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """The text of ``ids``; ``<unk>`` and padding ids decode as U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        chars, n = self.chars, len(self.chars)
        return "".join(chars[i - 1] if 1 <= i <= n else self.unk_char for i in ids)


class TextBatches:
    """Random windows of the corpus as ``(inputs, targets)`` LongTensors of shape (batch, seq_len).

    ``targets`` is ``inputs`` shifted left by one token. Every iteration restarts from ``seed``,
    so two iterations (or two objects with the same arguments) yield the same batches. The last
    ``val_fraction`` of the token stream is held out: ``split="val"`` samples only from it.
    Iteration is endless unless ``num_batches`` is given.
    """

    def __init__(
        self,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        num_batches: int | None = None,
        split: str = "train",
        val_fraction: float = 0.05,
        text: str | None = None,
        tokenizer: CharTokenizer | None = None,
    ):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.num_batches = num_batches
        self.tokenizer = tokenizer or CharTokenizer()
        tokens = self.tokenizer.encode_tensor(corpus_text() if text is None else text)
        cut = int(len(tokens) * (1.0 - val_fraction))
        self.tokens = tokens[:cut] if split == "train" else tokens[cut:]
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"the {split} split has {len(self.tokens)} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a shorter seq_len or more text"
            )

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("TextBatches without num_batches is endless and has no len()")
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        offsets = torch.arange(self.seq_len + 1)
        high = len(self.tokens) - self.seq_len
        step = 0
        while self.num_batches is None or step < self.num_batches:
            starts = torch.randint(0, high, (self.batch_size,), generator=gen)
            window = self.tokens[starts[:, None] + offsets]
            yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
            step += 1


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all tokens: ``logits[..., vocab]`` against ``targets[...]``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
