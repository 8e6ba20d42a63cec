"""Published measurements of large training runs: the table the planner's GPU figures are held to.

No GPU was used to make autopar's GPU presets; what they can be checked against is what others
measured and published. ``autopar/planner/data/published_runs.json`` keeps each run as data: the
model's shape, the GPUs and their nodes, the mesh (tp, pp, dp), the global batch and microbatch,
precision, recomputation, ZeRO stage, the measured figure, where it was published (URL and where in
the text) and what was assumed where the source is silent. :func:`published_runs` loads and
validates it (a :class:`PublishedRun` per row; a malformed row raises :class:`~autopar.errors.PlanError`
naming it). ``held_out`` rows are kept out of the fit (:mod:`autopar.planner.published_fit`).

The measured figure is a step time, or a throughput turned into one:

- ``step_s``: seconds per optimizer step, as published;
- ``tflops_per_gpu``: Megatron-LM's accounting (Narayanan et al. 2021, section 5.1): a step of a GPT
  model of ``l`` layers, width ``h``, vocabulary ``V``, ``B`` sequences of ``s`` tokens with full
  recomputation counts ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` FLOPs (72 without recomputation);
  step time = FLOPs / (GPUs x teraFLOP/s);
- ``tokens_per_s_per_gpu``: step time = ``B·s / (GPUs x tokens/s)``.

    >>> runs = published_runs()
    >>> run = next(r for r in runs if r.id == "mtnlg-530b-2240")
    >>> run.step_seconds, run.num_microbatches, (run.tp, run.pp, run.dp)
    (60.1, 240, (8, 35, 8))
    >>> round(next(r for r in runs if r.id == "megatron21-t1-gpt-1008b").step_seconds, 1)
    102.6
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from autopar.errors import PlanError
from autopar.plan_model import UserModel

__all__ = ["ModelShape", "Measured", "Source", "PublishedRun", "published_runs", "DATA", "megatron_flops"]

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"


class _Frozen(UserModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelShape(_Frozen):
    """A GPT model's shape (GPT-2 style: learned positions, LayerNorm, 4h GELU MLP, tied head)."""

    family: Literal["gpt"] = "gpt"
    hidden: int = Field(gt=0)
    layers: int = Field(gt=0)
    heads: int = Field(gt=0)
    vocab: int = Field(gt=0)
    seq: int = Field(gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelShape":
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        return self

    def build(self, *, device: str = "meta"):
        """The model (``autopar.models.gpt.GPT``) under ``torch.device(device)``: no weight allocated on meta."""
        import torch

        from autopar.models.gpt import GPT, GPTConfig
        cfg = GPTConfig(vocab_size=self.vocab, seq_len=self.seq, num_layers=self.layers, num_heads=self.heads,
                        hidden=self.hidden)
        with torch.device(device):
            return GPT(cfg)


def megatron_flops(shape: ModelShape, batch: int, *, recompute: bool) -> float:
    """FLOPs of one step as Megatron-LM counts them: ``(96 or 72)·B·s·l·h²·(1 + s/6h + V/16lh)``."""
    s, l, h, v = shape.seq, shape.layers, shape.hidden, shape.vocab
    return (96 if recompute else 72) * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


class Measured(_Frozen):
    """The published figure: a step time, or a throughput (see the module docstring)."""

    kind: Literal["step_s", "tflops_per_gpu", "tokens_per_s_per_gpu"]
    value: float = Field(gt=0)


class Source(_Frozen):
    """Where the figure was published: a URL and where in the text (table, row, section, quote)."""

    url: str = Field(pattern=r"^https://")
    where: str = Field(min_length=10)


class PublishedRun(_Frozen):
    """One published run: what ran, on what, and how fast."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$")
    model: ModelShape
    gpu: Literal["a100-80g", "a100-40g", "h100-80g"]
    gpus: int = Field(gt=0)
    devices_per_node: int = Field(8, gt=0)
    tp: int = Field(gt=0)
    pp: int = Field(gt=0)
    dp: int = Field(gt=0)
    schedule: Literal["1f1b", "interleaved_1f1b"] = "1f1b"
    virtual: int | None = Field(None, ge=1)  # stages per pp rank; None: not published (the planner picks)
    global_batch: int = Field(gt=0)
    microbatch: int = Field(gt=0)
    precision: Literal["fp16", "bf16"]
    recompute: Literal["none", "selective", "full"]
    zero: Literal[0, 1, 2, 3] = 0
    framework: Literal["megatron-lm", "megatron-deepspeed"] = "megatron-lm"  # the software that ran it
    measured: Measured
    source: Source
    assumptions: tuple[str, ...] = ()
    held_out: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> "PublishedRun":
        if self.tp * self.pp * self.dp != self.gpus:
            raise ValueError(f"tp {self.tp} x pp {self.pp} x dp {self.dp} is not its {self.gpus} GPUs")
        if self.global_batch % (self.dp * self.microbatch):
            raise ValueError(f"global batch {self.global_batch} is not dp {self.dp} x microbatch {self.microbatch} "
                             f"x a whole number of microbatches")
        if self.pp > self.model.layers or self.devices_per_node % self.tp or self.gpus % self.devices_per_node:
            raise ValueError(f"mesh tp={self.tp} pp={self.pp} does not fit {self.model.layers} layers on nodes of "
                             f"{self.devices_per_node}")
        if self.schedule == "1f1b" and self.virtual not in (None, 1):
            raise ValueError(f"1f1b runs one stage per rank, not virtual={self.virtual}")
        return self

    @property
    def local_batch(self) -> int:
        """Sequences per data-parallel replica."""
        return self.global_batch // self.dp

    @property
    def num_microbatches(self) -> int:
        return self.local_batch // self.microbatch

    @property
    def step_seconds(self) -> float:
        """The measured step time in seconds (a published throughput turned into one)."""
        m = self.measured
        if m.kind == "step_s":
            return m.value
        if m.kind == "tokens_per_s_per_gpu":
            return self.global_batch * self.model.seq / (self.gpus * m.value)
        flops = megatron_flops(self.model, self.global_batch, recompute=self.recompute == "full")
        return flops / (self.gpus * m.value * 1e12)


@functools.lru_cache(maxsize=4)
def published_runs(path: str | None = None) -> tuple[PublishedRun, ...]:
    """Every row of the table (``path``: another file of the same form), validated."""
    path = Path(path) if path else DATA
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the published runs at {path}: {exc}", where=str(path),
                        fix="restore autopar/planner/data/published_runs.json") from exc
    runs = []
    for i, row in enumerate(doc.get("runs", [])):
        try:
            runs.append(PublishedRun.model_validate(row))
        except (ValidationError, PlanError, TypeError) as exc:
            what = exc.what if isinstance(exc, PlanError) else str(exc)
            raise PlanError(f"published run {row.get('id', i) if isinstance(row, dict) else i!r} is malformed: {what}",
                            where=f"{path}: runs[{i}]", fix="correct the row (fields: PublishedRun)") from exc
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        raise PlanError(f"published run ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}", where=str(path),
                        fix="give every row its own id")
    return tuple(runs)
