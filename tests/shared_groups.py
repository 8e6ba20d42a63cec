"""The spawned process groups that the checkpoint, fault, real-world-model and held-storage tests share.

Starting a group costs seconds, so every spawned case of those tests is listed here and each group
runs once per pytest session (``result(case)``, cached). The default suite runs the 2-rank group
(it saves and reshards its own checkpoints) and the 1-rank group that loads its cp checkpoints on one
rank; the 4-rank group and the 2-rank group that loads the 4-rank group's checkpoints on fewer ranks are
``slow`` (tests/case_marks.py), run after one another.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile

from case_marks import by_world
from equivalence import Case, run_cases

from ckpt_runners import ROOT_ENV
from soak_runners import SOAK_CASES, SOAK_CASES_FOUR

_GPT4 = dict(model="gpt_tiny", overrides=(("num_layers", 4),), steps=4)
_R = "ckpt_runners:"


def _save(name, mesh, **kw) -> Case:
    return Case(mesh=mesh, kind=_R + "save", extra=(("name", name), ("save_after", 2)), **{**_GPT4, **kw})


def _resume(name, mesh, **kw) -> Case:
    return Case(mesh=mesh, kind=_R + "resume", extra=(("name", name),), **{**_GPT4, **kw})


# saved at tp=2, loaded at dp=2 and at pp=2 (SGD with momentum: its state must follow each parameter)
SAVE_T = _save("T", (1, 1, 2))
RESUME_T = [_resume("T", m) for m in [(2, 1, 1), (1, 2, 1)]]
# saved at pp=2, tp=2, loaded on 4 ranks and on 2
SAVE_A = _save("A", (1, 2, 2))
RESUME_A = [_resume("A", m) for m in [(4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 1, 2), (2, 1, 1)]]
# saved under ZeRO-3 (flat dp shards of tp shards), loaded under ZeRO-1 on another mesh
SAVE_Z = _save("Z", (2, 1, 2), options=(("zero_stage", 3),))
RESUME_Z = [_resume("Z", (1, 2, 2))]
# context parallelism (cp=2 inside dp=1; ZeRO over dp x cp): saved at cp=2 under ZeRO-1 and ZeRO-3, loaded at
# dp=2 and back at cp=2 under the other stage, and on one rank; saved at dp=2 under ZeRO-3, loaded at cp=2
_Z1, _Z3 = (("zero_stage", 1),), (("zero_stage", 3),)
SAVE_CP = [_save("CP1", (1, 1, 1), cp=2, options=_Z1), _save("CP3", (1, 1, 1), cp=2, options=_Z3),
           _save("DP3", (2, 1, 1), options=_Z3)]
RESUME_CP = [_resume("CP1", (2, 1, 1), options=_Z1), _resume("CP1", (1, 1, 1), cp=2, options=_Z3),
             _resume("CP3", (2, 1, 1), options=_Z1), _resume("CP3", (1, 1, 1), cp=2, options=_Z1),
             _resume("DP3", (1, 1, 1), cp=2, options=_Z3)]
RESUME_CP_ONE = [_resume("CP1", (1, 1, 1)), _resume("CP3", (1, 1, 1))]  # one rank, in a group of its own
# cp=2 x tp=2 under ZeRO-3 (tp shards cut flat over dp x cp), loaded at dp=2 x tp=2, pp=2 x cp=2 and tp=2 (slow)
SAVE_CP_FOUR = _save("CPT", (1, 1, 2), cp=2, options=_Z3)
RESUME_CP_FOUR = [_resume("CPT", (2, 1, 2), options=_Z1), _resume("CPT", (1, 2, 1), cp=2, options=_Z1),
                  _resume("CPT", (1, 1, 2), options=_Z1)]
# AdamW (state: step, exp_avg, exp_avg_sq; ZeRO-1 owners over dp=2) against the same run without a stop
_ADAM = dict(optimizer="adamw", lr=0.01)
ADAM_FULL = Case(mesh=(2, 1, 1), kind=_R + "uninterrupted", **{**_GPT4, **_ADAM})
SAVE_ADAM = _save("ADAM", (2, 1, 1), **_ADAM)
RESUME_ADAM = _resume("ADAM", (2, 1, 1), **_ADAM)

# dropout (default and tp streams): resumed on the same mesh exactly, on another re-derived
_DROP = dict(model="gpt_tiny", overrides=(("num_layers", 4), ("dropout", 0.1)), steps=4)
# (saved at pp=2 x tp=2, resharded to dp=2 x tp=2; and saved at tp=2, resharded to dp=2)
DROPOUT_RESUME = [Case(mesh=m, kind=_R + "dropout_resume", extra=(("name", n), ("save_after", 2)), **_DROP)
                  for n, m in (("D", (1, 2, 2)), ("D2", (1, 1, 2)))]
DROPOUT_RESHARD = [Case(mesh=m, kind=_R + "dropout_reshard", extra=(("name", n),), **_DROP)
                   for n, m in (("D", (2, 1, 2)), ("D2", (2, 1, 1)))]

CRASH = Case(mesh=(1, 2, 1), kind=_R + "crash_while_saving", extra=(("name", "C"),), **_GPT4)
BAD = Case(mesh=(1, 1, 2), kind=_R + "bad_checkpoints", extra=(("name", "B"),), **_GPT4)
ROUNDTRIP = Case(mesh=(2, 1, 1), kind=_R + "full_state_dict_roundtrip", extra=(("save_after", 2),), **_GPT4)
NONFINITE = Case(mesh=(1, 2, 1), kind=_R + "nonfinite", **_GPT4)
# tensors the forward never reads (tests/ckpt_runners.py _with_spare): saved at pp=2, loaded at tp=2
UNUSED_SAVE = Case(mesh=(1, 2, 1), kind=_R + "unused_save", extra=(("name", "U"),), **_GPT4)
UNUSED_RESUME = Case(mesh=(1, 1, 2), kind=_R + "unused_resume", extra=(("name", "U"),), **_GPT4)
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

# (group, its cases): each group runs in the order listed, a checkpoint's saver before its loaders
GROUPS = {
    "two": [*HF_CASES, SAVE_T, *RESUME_T, *SAVE_CP, *RESUME_CP, ADAM_FULL, SAVE_ADAM, RESUME_ADAM, DROPOUT_RESUME[1], DROPOUT_RESHARD[1],
            CRASH, BAD, ROUNDTRIP, UNUSED_SAVE, UNUSED_RESUME, NONFINITE, *SOAK_CASES, P2P_TIMEOUT,
            COLLECTIVE_TIMEOUT],
    "four": [SAVE_A, *RESUME_A[:3], SAVE_Z, *RESUME_Z, SAVE_CP_FOUR, *RESUME_CP_FOUR[:2], DROPOUT_RESUME[0],
             DROPOUT_RESHARD[0], INDEX_RANGE, *SOAK_CASES_FOUR],
    "two_from_four": RESUME_A[3:] + RESUME_CP_FOUR[2:],
    "one_from_two": RESUME_CP_ONE,
}
_AFTER = {"two_from_four": "four", "one_from_two": "two"}  # loads the checkpoints that group saves
SLOW_GROUPS = ("four", "two_from_four")
_GROUP_OF = {case: name for name, cases in GROUPS.items() for case in cases}


def is_slow(case: Case) -> bool:
    return _GROUP_OF[case] in SLOW_GROUPS


def params(cases) -> list:
    """``cases`` as pytest params named by the case, those of a slow group marked ``slow``."""
    return by_world(cases, world_of=lambda c: "slow" if is_slow(c) else "default", ids=lambda c: c.name(),
                    slow_worlds=("slow",))


@functools.lru_cache(maxsize=None)
def checkpoint_root() -> str:
    root = tempfile.mkdtemp(prefix="autopar-ckpt-")
    atexit.register(shutil.rmtree, root, True)
    os.environ[ROOT_ENV] = root  # the spawned workers inherit it
    return root


@functools.lru_cache(maxsize=None)
def _results(group: str) -> dict:
    checkpoint_root()
    if group in _AFTER:
        _results(_AFTER[group])
    cases = GROUPS[group]
    return dict(zip(cases, run_cases(cases, timeout_s=900)))  # a hang guard: the 2-rank group takes ~5 min loaded


def result(case: Case) -> dict:
    """Rank 0's result of ``case``, from the one run of its group."""
    return _results(_GROUP_OF[case])[case]
