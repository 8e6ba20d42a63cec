"""The plan fuzzer's scenarios and property (tests/api/test_fuzz_plan.py; nightly size: bench/fuzz_plan.py).

A :class:`Scenario` is a small model, a mesh, options, a schedule, a batch size and, half of the time,
one injected user mistake. The property (:func:`check_scenario`): ``autopar.plan`` either plans or
raises an :class:`autopar.AutoparError` with ``what``, ``where`` and ``fix`` filled. It fails on a
foreign exception, on a call that runs past :data:`TIMEOUT_S` (a hang), on a success despite the
injected mistake, and on a success whose Plan does not say what was asked (mesh, batch, schedule,
microbatches dividing the batch, one program per rank).

Speed: the models are tiny and built once; :func:`cached_capture` memoises the tracer's result per
(model, input shapes, loss, mode) and hands each call a deep copy, so a plan re-runs everything after
capture (analyses, validation, passes, lowering) but not torch.export, which is deterministic for
the same module and shapes. Most scenarios (mistakes, indivisible sizes) end before capture anyway.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import signal
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import autopar
from autopar.models import build_model, lm_loss
from autopar.models.mlp import MLP, MLPConfig
from autopar.plan_model import MeshShape, Plan
from autopar.runtime.schedules.registry import schedule_names

__all__ = ["Scenario", "scenarios", "check_scenario", "cached_capture", "MISTAKES", "TIMEOUT_S"]

TIMEOUT_S = 30  # one plan of these models takes well under a second; past this it is a hang
VOCAB, POSITIONS = 32, 16

MISTAKES = ("str_input", "array_input", "function_model", "target_batch", "vector_loss", "plan_other_mesh",
            "sp_without_tp", "no_params", "token_range", "long_sequence", "unknown_option", "bad_zero_stage",
            "bad_mesh", "target_without_loss", "empty_batch", "scalar_input", "float_ids", "rank_outside",
            "mesh_as_int")


class TinyLM(nn.Module):
    """Token and position embeddings, two MLP blocks, a head: the index lookups of a language model, small."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(POSITIONS, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


@functools.lru_cache(maxsize=None)
def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(MLPConfig(in_features=8, hidden=16, num_layers=4, out_features=4))
    if name == "lm":
        return TinyLM()
    return build_model("gpt_tiny")


def _inputs(name: str, batch: int, seq: int):
    g = torch.Generator().manual_seed(batch * 100 + seq)
    if name == "mlp":
        return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g), F.mse_loss
    vocab = VOCAB if name == "lm" else 128
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.randint(0, vocab, (batch, seq), generator=g), lm_loss


def _per_element_mse(output, target):
    return F.mse_loss(output, target, reduction="none")


def _per_token_lm(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")


@dataclass(frozen=True)
class Scenario:
    model: str
    mesh: tuple[int, int, int]
    batch: int
    seq: int
    options: tuple = ()  # (name, value) pairs
    mistake: str | None = None
    ranks: tuple[int, ...] | None = None

    def call(self) -> dict:
        """The keyword arguments of ``autopar.plan`` this scenario makes, its mistake included."""
        x, y, loss = _inputs(self.model, self.batch, self.seq)
        kw = dict(model=model(self.model), mesh_shape=dict(zip(("dp", "pp", "tp"), self.mesh)), example_inputs=(x,),
                  loss_fn=loss, example_target=y, ranks=list(self.ranks) if self.ranks is not None else None,
                  **dict(self.options))
        bad = self.mistake
        if bad == "str_input":
            kw["example_inputs"] = ("the quick brown fox",)
        elif bad == "array_input":
            kw["example_inputs"] = (x.numpy(),)
        elif bad == "function_model":
            kw["model"] = lambda t: t
        elif bad == "target_batch":
            kw["example_target"] = torch.cat([y, y[:1]])
        elif bad == "vector_loss":
            kw["loss_fn"] = _per_element_mse if self.model == "mlp" else _per_token_lm
        elif bad == "plan_other_mesh":
            other = MeshShape(dp=self.mesh[0], pp=self.mesh[1], tp=self.mesh[2] * 2)
            kw["plan"] = Plan(model_name=type(kw["model"]).__name__, mesh=other, global_batch_size=self.mesh[0])
        elif bad == "sp_without_tp":
            kw["sequence_parallel"] = True
            kw["mesh_shape"] = {**kw["mesh_shape"], "tp": 1}
        elif bad == "no_params":
            kw["model"] = NoParams()
        elif bad == "token_range":  # (the MLP has no token ids: the LM stands in for it)
            name = "lm" if self.model == "mlp" else self.model
            x, y, _ = _inputs(name, self.batch, self.seq)
            kw.update(model=model(name), example_inputs=(x + (VOCAB if name == "lm" else 128),), example_target=y,
                      loss_fn=lm_loss)
        elif bad == "long_sequence":  # TinyLM's position table has 16 rows and no check of its own
            x, y, _ = _inputs("lm", self.batch, POSITIONS + self.seq)
            kw.update(model=model("lm"), example_inputs=(x,), example_target=y, loss_fn=lm_loss)
        elif bad == "unknown_option":
            kw["microbatches"] = 2
        elif bad == "bad_zero_stage":
            kw["zero_stage"] = 4
        elif bad == "bad_mesh":
            kw["mesh_shape"] = {**kw["mesh_shape"], "tp": 0}
        elif bad == "target_without_loss":
            kw["loss_fn"] = None
        elif bad == "empty_batch":
            kw.update(example_inputs=(x[:0],), example_target=y[:0])
        elif bad == "scalar_input":
            kw["example_inputs"] = (x.sum(),)
        elif bad == "float_ids":  # token ids as floats (the MLP's inputs are floats: the LM stands in)
            x, y, _ = _inputs("lm", self.batch, self.seq)
            kw.update(model=model("lm"), example_inputs=(x.float(),), example_target=y, loss_fn=lm_loss)
        elif bad == "rank_outside":
            kw["ranks"] = [self.mesh[0] * self.mesh[1] * self.mesh[2]]
        elif bad == "mesh_as_int":  # a world size is read only by the planner (plan="auto")
            kw["mesh_shape"] = self.mesh[0] * self.mesh[1] * self.mesh[2]
        return kw


@st.composite
def scenarios(draw) -> Scenario:
    """A model, a mesh of up to 8 ranks, options, a batch, and (half of the time) one user mistake."""
    name = draw(st.sampled_from(["mlp"] * 10 + ["lm"] * 5 + ["gpt"]))
    dp, pp, tp = (draw(st.sampled_from([1, 1, 2, 4])) for _ in range(3))
    if dp * pp * tp > 8:
        dp = 1
    batch = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16] if name != "gpt" else [4, 8]))
    seq = draw(st.sampled_from([4, 8])) if name == "lm" else 16
    options = {}
    if draw(st.booleans()):
        options["schedule"] = draw(st.sampled_from(schedule_names()))
    if draw(st.booleans()):
        options["num_microbatches"] = draw(st.sampled_from([1, 2, 3, 4, 8]))
    if draw(st.booleans()):
        options["zero_stage"] = draw(st.integers(0, 3))
    if tp > 1 and draw(st.booleans()):
        options["sequence_parallel"] = True
    if draw(st.integers(0, 3)) == 0:
        options["recompute"] = draw(st.sampled_from(["selective", "full"]))
    if draw(st.integers(0, 5)) == 0:
        options["tensor_parallel"] = False
    if draw(st.integers(0, 5)) == 0:
        options["capture"] = "symbolic_trace"
    if draw(st.integers(0, 7)) == 0:
        options["num_virtual"] = draw(st.sampled_from([1, 2]))
    if tp > 1 and draw(st.integers(0, 5)) == 0:
        options["vocab_parallel"] = draw(st.booleans())
    if draw(st.integers(0, 15)) == 0:  # (a bf16 copy of the model is captured anew: rarer)
        options["precision"] = "bf16"
    if draw(st.integers(0, 9)) == 0:
        options["data_parallel"] = "dataparallel"
    mistake = draw(st.sampled_from(MISTAKES)) if draw(st.booleans()) else None
    ranks = (draw(st.integers(0, dp * pp * tp - 1)),) if draw(st.booleans()) else None
    return Scenario(model=name, mesh=(dp, pp, tp), batch=batch, seq=seq, options=tuple(sorted(options.items())),
                    mistake=mistake, ranks=ranks)


class PlanTimeout(Exception):
    """A plan that ran past TIMEOUT_S: the fuzzer's hang."""


@contextlib.contextmanager
def _deadline(seconds: int):
    def fire(signum, frame):
        raise PlanTimeout(f"autopar.plan ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def cached_capture():
    """Memoise the tracer per (model, input shapes and dtypes, loss, mode); each call gets a deep copy."""
    import autopar.passes.frontend.capture_model as lowering  # the capture pass's tracer

    real = lowering.capture
    memo: dict = {}

    def key_of(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device.type)
        if isinstance(value, (tuple, list)):
            return tuple(key_of(v) for v in value)
        return ("object", id(value))

    def capture(model, example_inputs, **kwargs):
        key = (id(model), key_of(tuple(example_inputs)), tuple(sorted((k, key_of(v)) for k, v in kwargs.items())))
        if key not in memo:
            memo[key] = (model, real(model, example_inputs, **kwargs))  # the model is kept alive with its id
        return copy.deepcopy(memo[key][1])

    lowering.capture = capture
    try:
        yield memo
    finally:
        lowering.capture = real


def _check_error(exc: autopar.AutoparError) -> None:
    assert exc.what and exc.where and exc.fix, f"{type(exc).__name__} lacks what/where/fix: {exc}"
    text = str(exc)
    assert "Where: " in text and "Fix: " in text, text


def _check_plan(s: Scenario, result) -> None:
    """A success says what was asked: mesh, batch, schedule, microbatches, one program per rank."""
    opts = dict(s.options)
    plan = result.plan
    assert plan.mesh == MeshShape(dp=s.mesh[0], pp=s.mesh[1], tp=s.mesh[2]), plan.mesh
    assert plan.global_batch_size == s.batch
    m = plan.pipeline.num_microbatches
    assert s.batch % (s.mesh[0] * m) == 0, (s.batch, m)
    if opts.get("data_parallel") == "dataparallel":  # the rank-0 baseline: one pass, rank 0 steps, no ZeRO
        assert (plan.pipeline.schedule, m, plan.zero_stage) == ("gpipe", 1, 0), plan.pipeline
    else:
        assert plan.pipeline.schedule == opts.get("schedule", "1f1b")
        if "num_microbatches" in opts:
            assert m == opts["num_microbatches"]
        assert plan.zero_stage == opts.get("zero_stage", 1)
    assert plan.sequence_parallel == (bool(opts.get("sequence_parallel")) and s.mesh[2] > 1
                                      and opts.get("tensor_parallel", True))
    world = s.mesh[0] * s.mesh[1] * s.mesh[2]
    assert sorted(result.ranks) == (list(s.ranks) if s.ranks is not None else list(range(world)))
    for graphs in result.ranks.values():
        assert graphs.stages, f"rank {graphs.rank} runs no stage"


def check_scenario(s: Scenario) -> str:
    """Plan ``s``: 'planned' or 'refused'; an AssertionError or a foreign exception is a fuzzer failure."""
    kwargs = s.call()
    model_, mesh = kwargs.pop("model"), kwargs.pop("mesh_shape")
    with _deadline(TIMEOUT_S):
        try:
            result = autopar.plan(model_, mesh, **kwargs)
        except autopar.AutoparError as exc:
            _check_error(exc)
            return "refused"
    assert s.mistake is None, f"planned despite the mistake {s.mistake!r}: {s}"
    _check_plan(s, result)
    return "planned"


def text_inputs_target():
    """A CLI target (``plan_fuzz:text_inputs_target``) that returns a model with text for its inputs."""
    return model("mlp"), ("the quick brown fox",)
