"""The spawned process groups that the spawned tests of the suite share: one group per world size.

Starting a group costs seconds (a 4-rank start about 8 s on 2 cores), so the runner modules and
test modules :func:`register` their cases at import, which pytest does for every module it
collects before any test runs; each world size then runs once per pytest session
(:func:`results`), holding the cases of every collected module. A case registered later (a
module imported after its world's group ran) runs in a group of its own on first use. Equal
cases registered by two modules run once.

Order: the 2-rank group loads checkpoints that the 4-rank group saved, so it runs after it;
cases that poison their own group (a p2p or collective timeout) are registered ``last``.
"""
from __future__ import annotations

import atexit
import importlib.util
import functools
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

_REGISTERED: dict[int, dict] = {}  # world -> {case: None}, in registration order
_LAST: dict[int, dict] = {}  # world -> the cases that must run after every other one
_DONE: dict[int, dict] = {}  # world -> {case: rank 0's judged result}
_SETUP: dict = {}  # what must run in this process before the groups start (files the workers read)


def register(cases, *, last: bool = False, setup=None) -> None:
    """Add ``cases`` to the session's group of their world size (``last``: after every other case);
    ``setup()``: called once, in this process, before the first group that holds them starts."""
    for case in cases:
        (_LAST if last else _REGISTERED).setdefault(case.world_size, {})[case] = None
    if setup is not None:
        _SETUP.setdefault(setup, False)


def _timeout_s(cases) -> float:
    return 300 + 90 * len(cases)  # the whole group's deadline: a loaded 2-core host runs a case in < 90 s


def results(world: int) -> dict:
    """{case: rank 0's result} of every case registered for ``world`` ranks (the 4-rank group first: it saves)."""
    checkpoint_root()
    if world == 2 and RESUME_A[3] in _REGISTERED.get(2, {}):  # resumes what the 4-rank group saved
        results(4)
    done = _DONE.setdefault(world, {})
    wanted = list(_REGISTERED.get(world, {})) + [c for c in _LAST.get(world, {}) if c not in _REGISTERED.get(world, {})]
    missing = [c for c in wanted if c not in done]
    for setup, ran in list(_SETUP.items()):
        if missing and not ran:
            setup()
            _SETUP[setup] = True
    if missing:
        done.update(zip(missing, run_cases(missing, timeout_s=_timeout_s(missing))))
    return done


def result(case: Case) -> dict:
    """Rank 0's judged result of one registered case."""
    found = results(case.world_size)
    if case not in found:  # registered by nobody: run it now, alone
        register([case])
        found = results(case.world_size)
    return found[case]


def register_checkpoint_cases() -> None:
    """The checkpoint, fault, index-guard and real-world-model cases (their test modules call it at import)."""
    register([SAVE_A, *RESUME_A[:3], SAVE_Z, *RESUME_Z, DROPOUT_RESUME, DROPOUT_RESHARD, INDEX_RANGE])
    register([*HF_CASES, *RESUME_A[3:], ADAM_FULL, SAVE_ADAM, RESUME_ADAM, CRASH, BAD, ROUNDTRIP, NONFINITE])
    register([P2P_TIMEOUT, COLLECTIVE_TIMEOUT], last=True)  # each poisons its own group: keep them last


@functools.lru_cache(maxsize=None)
def checkpoint_root() -> str:
    root = tempfile.mkdtemp(prefix="autopar-ckpt-")
    atexit.register(shutil.rmtree, root, True)
    os.environ[ROOT_ENV] = root  # the spawned workers inherit it
    return root
