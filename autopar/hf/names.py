"""The library's tensor names against the program's: the transformers model inside the user's model.

The program names every weight as the user's single-device model does (``program.state_keys``,
``model.state_dict()``'s keys). A checkpoint names them as the ``transformers`` model that saved
it. The two differ by a prefix only:

- the user's model may wrap the library's (``self.hf = LlamaForCausalLM(config)``: ``hf.`` in front);
- a checkpoint of the base model (``LlamaModel``) lacks the head model's ``base_model_prefix``
  (``model.``), and one of the head model loaded into the base model has one too many.

:func:`checkpoint_to_program` finds that prefix from the names alone (the one change that maps the
most checkpoint names onto program names), so it needs no library class; :func:`find_hf_model`
finds the library's model inside the user's (``named_modules``), for the names it drops on save
(tied weights) and the patterns it ignores on load.

Example::

    >>> program_keys = ["hf.model.embed.weight", "hf.lm_head.weight"]
    >>> checkpoint_to_program(["model.embed.weight", "lm_head.weight"], program_keys)
    {'model.embed.weight': 'hf.model.embed.weight', 'lm_head.weight': 'hf.lm_head.weight'}
    >>> checkpoint_to_program(["embed.weight"], ["model.embed.weight", "lm_head.weight"])
    {'embed.weight': 'model.embed.weight'}
"""
from __future__ import annotations

import re

import torch.nn as nn

__all__ = ["find_hf_model", "library_class", "checkpoint_to_program", "ignored_on_load", "tied_targets"]


def _is_pretrained(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def find_hf_model(model: nn.Module | None) -> tuple[str, nn.Module] | None:
    """(module path + ".", or "" for the model itself; the module) of the outermost transformers
    ``PreTrainedModel`` in ``model``, or None when there is none."""
    if model is None:
        return None
    for path, module in model.named_modules():
        if _is_pretrained(module):
            return (path + "." if path else ""), module
    return None


def library_class(module: nn.Module) -> type:
    """The transformers class a model is or derives from (a subclass such as autopar.models.hf's
    logits-only classes is saved as its library parent)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("transformers."))


def _candidates(checkpoint: list[str], program: set[str]) -> set[tuple[str, str]]:
    """("add"/"strip", prefix) pairs seen where a checkpoint name and a program name differ by a dotted prefix."""
    out = {("add", "")}
    for c in sorted(checkpoint, key=len, reverse=True)[:8]:  # the longest names are the most specific
        for k in program:
            if k != c and k.endswith("." + c):
                out.add(("add", k[:-len(c)]))
            elif k != c and c.endswith("." + k):
                out.add(("strip", c[:-len(k)]))
    return out


def _apply(change: tuple[str, str], name: str) -> str | None:
    kind, prefix = change
    if kind == "add":
        return prefix + name
    return name[len(prefix):] if name.startswith(prefix) else None


def checkpoint_to_program(checkpoint: list[str], program_keys) -> dict[str, str]:
    """{checkpoint name: program name} under the prefix change that maps the most names (ties: the
    shortest change); names that map to no program name are left out (the caller reports them)."""
    program = set(program_keys)
    best, best_score = ("add", ""), -1
    for change in sorted(_candidates(checkpoint, program), key=lambda c: (len(c[1]), c)):
        score = sum(_apply(change, c) in program for c in checkpoint)
        if score > best_score:
            best, best_score = change, score
    mapped = {c: _apply(best, c) for c in checkpoint}
    return {c: k for c, k in mapped.items() if k in program}


def ignored_on_load(hf_model: nn.Module | None, names: list[str]) -> set[str]:
    """The names the library's class ignores when they are unexpected (``_keys_to_ignore_on_load_unexpected``,
    e.g. GPT-2's ``attn.bias`` masks in old checkpoints)."""
    patterns = [] if hf_model is None else list(getattr(type(hf_model), "_keys_to_ignore_on_load_unexpected", None)
                                                 or [])
    return {n for n in names if any(re.search(p, n) for p in patterns)}


def tied_targets(hf_model: nn.Module | None) -> set[str]:
    """The library names the model ties to another weight and does not save (``lm_head.weight``)."""
    if hf_model is None:
        return set()
    tied = getattr(hf_model, "all_tied_weights_keys", None)  # transformers 5: {target: source}
    if isinstance(tied, dict):
        return set(tied)
    return set()
