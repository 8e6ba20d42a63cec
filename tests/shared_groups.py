"""The spawned process groups that the checkpoint, fault and real-world-model tests share.

Starting a group costs seconds, so every spawned case of those tests is listed here and each world
size runs once per pytest session (``results(world)``, cached). The 2-rank group loads checkpoints
that the 4-rank group saved, so it runs after it.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile

from equivalence import Case, run_cases

from ckpt_runners import ROOT_ENV

_GPT4 = dict(model="gpt_tiny", overrides=(("num_layers", 4),), steps=4)
_R = "ckpt_runners:"


def _save(name, mesh, **kw) -> Case:
    return Case(mesh=mesh, kind=_R + "save", extra=(("name", name), ("save_after", 2)), **{**_GPT4, **kw})


def _resume(name, mesh, **kw) -> Case:
    return Case(mesh=mesh, kind=_R + "resume", extra=(("name", name),), **{**_GPT4, **kw})


# saved at pp=2, tp=2 (SGD with momentum: its state must follow each parameter)
SAVE_A = _save("A", (1, 2, 2))
RESUME_A = [_resume("A", m) for m in [(4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 1, 2), (2, 1, 1)]]
# saved under ZeRO-3 (flat dp shards of tp shards), loaded under ZeRO-1 on another mesh
SAVE_Z = _save("Z", (2, 1, 2), options=(("zero_stage", 3),))
RESUME_Z = [_resume("Z", (1, 2, 2))]
# AdamW (state: step, exp_avg, exp_avg_sq; ZeRO-1 owners over dp=2) against the same run without a stop
_ADAM = dict(optimizer="adamw", lr=0.01)
ADAM_FULL = Case(mesh=(2, 1, 1), kind=_R + "uninterrupted", **{**_GPT4, **_ADAM})
SAVE_ADAM = _save("ADAM", (2, 1, 1), **_ADAM)
RESUME_ADAM = _resume("ADAM", (2, 1, 1), **_ADAM)

# dropout (default and tp streams): resumed on the same mesh exactly, on another re-derived
_DROP = dict(model="gpt_tiny", overrides=(("num_layers", 4), ("dropout", 0.1)), steps=4)
DROPOUT_RESUME = Case(mesh=(1, 2, 2), kind=_R + "dropout_resume", extra=(("name", "D"), ("save_after", 2)), **_DROP)
DROPOUT_RESHARD = Case(mesh=(2, 1, 2), kind=_R + "dropout_reshard", extra=(("name", "D"),), **_DROP)

CRASH = Case(mesh=(1, 2, 1), kind=_R + "crash_while_saving", extra=(("name", "C"),), **_GPT4)
BAD = Case(mesh=(1, 1, 2), kind=_R + "bad_checkpoints", extra=(("name", "B"),), **_GPT4)
ROUNDTRIP = Case(mesh=(2, 1, 1), kind=_R + "full_state_dict_roundtrip", extra=(("save_after", 2),), **_GPT4)
NONFINITE = Case(mesh=(1, 2, 1), kind=_R + "nonfinite", **_GPT4)
P2P_TIMEOUT = Case(mesh=(1, 2, 1), kind=_R + "p2p_timeout", **_GPT4)  # poisons its own group: keep it last
COLLECTIVE_TIMEOUT = Case(mesh=(2, 1, 1), kind=_R + "collective_timeout", **_GPT4)  # its own groups too
# a token id past the embedding on one rank of pp=2 x tp=2 (tests/guard_runners.py); the group stays usable
INDEX_RANGE = Case(mesh=(1, 2, 2), kind="guard_runners:index_out_of_range", **_GPT4)

# models nobody here wrote (transformers): every family on pp and tp, two on dp too (the 2 x 2 meshes
# and Qwen2 are in docs/coverage.md); BatchNorm's ResNet with one microbatch
HF_CASES = [
    Case(model="hf_gpt2", mesh=(2, 1, 1)), Case(model="hf_gpt2", mesh=(1, 2, 1)),
    Case(model="hf_gpt2", mesh=(1, 1, 2)),
    Case(model="hf_llama", mesh=(1, 2, 1)), Case(model="hf_llama", mesh=(1, 1, 2)),
    Case(model="hf_bert", mesh=(2, 1, 1)), Case(model="hf_bert", mesh=(1, 1, 2)),
    Case(model="hf_convnext", mesh=(1, 2, 1)), Case(model="hf_convnext", mesh=(1, 1, 2)),
    Case(model="hf_resnet", mesh=(1, 2, 1), options=(("num_microbatches", 1), ("schedule", "gpipe"))),
    Case(model="hf_resnet", mesh=(1, 1, 2), options=(("num_microbatches", 1),)),
]

if importlib.util.find_spec("transformers") is None:  # the [test] extra installs it; without it, skip those
    HF_CASES = []

GROUPS = {
    4: [SAVE_A, *RESUME_A[:3], SAVE_Z, *RESUME_Z, DROPOUT_RESUME, DROPOUT_RESHARD, INDEX_RANGE],
    2: [*HF_CASES, *RESUME_A[3:], ADAM_FULL, SAVE_ADAM, RESUME_ADAM, CRASH, BAD, ROUNDTRIP, NONFINITE,
        P2P_TIMEOUT, COLLECTIVE_TIMEOUT],
}


@functools.lru_cache(maxsize=None)
def checkpoint_root() -> str:
    root = tempfile.mkdtemp(prefix="autopar-ckpt-")
    atexit.register(shutil.rmtree, root, True)
    os.environ[ROOT_ENV] = root  # the spawned workers inherit it
    return root


@functools.lru_cache(maxsize=None)
def results(world: int) -> dict:
    """{case: rank 0's result} of the ``world``-rank group (the 4-rank group first: it saves)."""
    checkpoint_root()
    if world == 2:
        results(4)
    cases = GROUPS[world]
    return dict(zip(cases, run_cases(cases)))
