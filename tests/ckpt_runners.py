"""Runner kinds for the equivalence harness: checkpoints across meshes, crashes while saving, bad
checkpoints, NaNs and p2p timeouts. Each is ``kind="ckpt_runners:<function>"`` in a
:class:`equivalence.Case`; ``case.extra`` holds its own settings. Checkpoints go under the folder
named by the environment variable ``AUTOPAR_TEST_CKPT`` (set by the test before spawning).
"""
from __future__ import annotations

import os

import torch

from equivalence import batches, build, make_optimizer, replica_record, scrambled

ROOT_ENV = "AUTOPAR_TEST_CKPT"


def _root(case, key: str = "name") -> str:
    return os.path.join(os.environ[ROOT_ENV], dict(case.extra)[key])


def _compile(case, mesh, model=None, loss_fn=None):
    import autopar
    from autopar.models import lm_loss
    model = model if model is not None else build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=loss_fn or lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                              **dict(case.options))
    return program, data


def _train(program, data) -> list[float]:
    return [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]


def _scrambled(case):
    """The case's model with other weights: what a load must overwrite."""
    return scrambled(build(case))


def save(case, mesh) -> dict:
    """Train the first ``save_after`` steps and save; the losses of those steps."""
    program, data = _compile(case, mesh)
    k = dict(case.extra)["save_after"]
    losses = _train(program, data[:k])
    folder = program.save_checkpoint(_root(case))
    return {"losses": losses, "folder": folder, "step": program.step_count}


def resume(case, mesh) -> dict:
    """Compile with other weights, load the checkpoint, train the remaining steps."""
    program, data = _compile(case, mesh, model=_scrambled(case))
    step = program.load_checkpoint(_root(case))
    losses = _train(program, data[step:])
    return {"losses": losses, "state": program.full_state_dict(), "step": step, **replica_record(program)}


def uninterrupted(case, mesh) -> dict:
    """The same run without a stop, on this mesh (judges optimizers whose state is not linear, AdamW)."""
    program, data = _compile(case, mesh)
    return {"losses": _train(program, data), "state": program.full_state_dict(), **replica_record(program)}


def dropout_resume(case, mesh) -> dict:
    """With dropout. Run A: ``save_after`` steps, save, the remaining steps. Run B: a fresh program
    (other weights, another default random stream) loads the checkpoint and trains the remaining
    steps. Then the checkpoint loaded once more with the default stream reseeded: the first loss
    differs from A's (the masks matter, so A == B says the random state came back)."""
    program, data = _compile(case, mesh)
    k, root = dict(case.extra)["save_after"], _root(case)
    first = _train(program, data[:k])
    program.save_checkpoint(root)
    a = {"losses": _train(program, data[k:]), "state": program.full_state_dict()}
    fresh, _ = _compile(case, mesh, model=_scrambled(case))
    torch.manual_seed(4321)
    step = fresh.load_checkpoint(root)
    b = {"losses": _train(fresh, data[step:]), "state": fresh.full_state_dict()}
    fresh.load_checkpoint(root)
    torch.manual_seed(4321)  # the default stream not restored (tp streams are)
    other = _train(fresh, data[step:step + 1])
    return {"first": first, "a": a, "b": b, "step": step, "unrestored_loss": other[0]}


def dropout_reshard(case, mesh) -> dict:
    """Load the dropout checkpoint on another mesh: every rank re-seeded from (saved seed, step), its
    tp streams from the same seed and its tp rank, logged; twice the same losses."""
    import logging

    import torch.distributed as dist
    from autopar.ops.tp_rng import tp_rng_seed
    from autopar.runtime.checkpoints import checkpoint_files as files
    from autopar.runtime.checkpoints.rng_state import _trackers, derived_seed
    root = _root(case)
    saved = files.read_manifest(files.resolve(root))
    expected = derived_seed(saved["rng"]["seed"], saved["step"])
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("autopar.runtime.checkpoints.checkpoint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        runs, checks = [], []
        for _ in range(2):
            program, data = _compile(case, mesh, model=_scrambled(case))
            torch.manual_seed(4321)
            step = program.load_checkpoint(root)
            tp_rank = program.info.coords["tp"]
            trackers = _trackers(program)
            checks.append(torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(expected).get_state())
                          and bool(trackers) == (program.plan.mesh.tp > 1)
                          and all(t.seed == tp_rng_seed(expected, tp_rank) and torch.equal(
                              t.cpu_state, torch.Generator().manual_seed(t.seed).get_state()) for t in trackers))
            runs.append(_train(program, data[step:]))
    finally:
        logger.removeHandler(handler)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, all(checks))
    return {"runs": runs, "reseeded": every, "log": [r for r in records if "random state" in r]}


def _fails(fn, error_type) -> str:
    try:
        fn()
    except error_type as exc:
        return str(exc)
    raise AssertionError(f"expected {error_type.__name__}")


def crash_while_saving(case, mesh) -> dict:
    """A writer that raises mid-save on rank 1: CheckpointError everywhere, the previous one intact."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from autopar.errors import CheckpointError
    program, data = _compile(case, mesh)
    root = _root(case)
    _train(program, data[:1])
    program.save_checkpoint(root)
    saved = program.full_state_dict()
    _train(program, data[1:2])
    original = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("simulated crash: disk went away mid-save")
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = broken
    try:
        message = _fails(lambda: program.save_checkpoint(root), CheckpointError)
    finally:
        dcp.FileSystemWriter.write_data = original
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    step = program.load_checkpoint(root)
    after = program.full_state_dict()
    same = all(torch.equal(after[k], saved[k]) for k in saved)
    leftovers = sorted(n for n in os.listdir(root) if n.startswith(".tmp"))
    return {"message": message, "latest": latest, "step": step, "same": same, "leftovers": leftovers}


def _corrupt_piece(folder: str) -> None:
    """Flip 4 bytes in the middle of the largest piece's stored bytes (its tensor data)."""
    import torch.distributed.checkpoint as dcp
    storage = dcp.FileSystemReader(folder).read_metadata().storage_data
    info = max(storage.values(), key=lambda i: i.length)
    with open(os.path.join(folder, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        chunk = f.read(4)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def bad_checkpoints(case, mesh) -> dict:
    """Another model's checkpoint, a flipped byte, a truncated index, a garbled manifest: each a
    CheckpointError on every rank, and the weights stay as they were."""
    import dataclasses
    import shutil

    import torch.distributed as dist
    from autopar.errors import CheckpointError
    root = _root(case)
    program, data = _compile(case, mesh)
    _train(program, data[:1])
    folder = program.save_checkpoint(root)
    other = dataclasses.replace(case, model="llama_tiny", overrides=(("num_layers", 4),))
    other_program, _ = _compile(other, mesh)
    before = other_program.full_state_dict()
    out = {"other_model": _fails(lambda: other_program.load_checkpoint(root), CheckpointError)}
    out["other_unchanged"] = all(torch.equal(v, other_program.full_state_dict()[k]) for k, v in before.items())
    before = program.full_state_dict()
    copies = {}
    for kind in ("flipped", "index", "manifest"):
        copies[kind] = os.path.join(os.environ[ROOT_ENV], f"{dict(case.extra)['name']}-{kind}")
        if dist.get_rank() == 0:
            shutil.rmtree(copies[kind], ignore_errors=True)
            shutil.copytree(folder, copies[kind])
            if kind == "flipped":
                _corrupt_piece(copies[kind])
            elif kind == "index":
                with open(os.path.join(copies[kind], ".metadata"), "r+b") as f:
                    f.truncate(40)
            else:
                with open(os.path.join(copies[kind], "autopar.json"), "w") as f:
                    f.write("{not json")
        dist.barrier()
        out[kind] = _fails(lambda: program.load_checkpoint(copies[kind]), CheckpointError)
    out["missing"] = _fails(lambda: program.load_checkpoint(root + "-nowhere"), CheckpointError)
    sd = {k: v for k, v in before.items() if k != "blocks.0.mlp.fc.weight"}
    out["state_dict"] = _fails(lambda: program.load_full_state_dict(sd), CheckpointError)
    out["unchanged"] = all(torch.equal(v, program.full_state_dict()[k]) for k, v in before.items())
    return out


def full_state_dict_roundtrip(case, mesh) -> dict:
    """Export after ``save_after`` steps (the single-device model loads it as is); a program compiled
    from other weights starts from it, with a fresh optimizer, and trains the remaining steps."""
    program, data = _compile(case, mesh)
    k = dict(case.extra)["save_after"]
    first = _train(program, data[:k])
    exported = program.full_state_dict()
    build(case).load_state_dict(exported, strict=True)
    fresh, _ = _compile(case, mesh, model=_scrambled(case))
    fresh.load_full_state_dict(exported)
    return {"first": first, "exported": exported, "losses": _train(fresh, data[k:]),
            "state": fresh.full_state_dict(), **replica_record(fresh)}


def nonfinite(case, mesh) -> dict:
    """A weight set to inf before step 2 (NaN loss), and a loss whose gradient alone is NaN."""
    from autopar.errors import NumericsError
    from autopar.models import lm_loss
    program, data = _compile(case, mesh)
    _train(program, data[:1])
    name, param = program.named_params[0]
    if program.info.coords["pp"] == 0:
        with torch.no_grad():
            param.view(-1)[0] = float("inf")
    out = {"loss": _fails(lambda: _train(program, data[1:2]), NumericsError)}

    def nan_grad_loss(logits, target):  # value finite, gradient NaN: 0 * d sqrt(x)/dx at x = 0
        return lm_loss(logits, target) + 0.0 * torch.sqrt(logits.sum() * 0.0)

    program2, _ = _compile(case, mesh, loss_fn=nan_grad_loss)
    before = program2.full_state_dict()
    out["grad"] = _fails(lambda: _train(program2, data[:1]), NumericsError)
    out["unchanged"] = all(torch.equal(v, program2.full_state_dict()[k]) for k, v in before.items())
    out["step_count"] = program2.step_count
    return out


def p2p_timeout(case, mesh) -> dict:
    """Stage 0 skips its step: stage 1's receive gives up after p2p_timeout_s with a RuntimeCommError."""
    import dataclasses

    import torch.distributed as dist
    from autopar.errors import RuntimeCommError
    from torch.distributed.device_mesh import DeviceMesh
    case = dataclasses.replace(case, options=tuple(case.options) + (("p2p_timeout_s", 2.0),))
    import autopar
    from autopar.models import lm_loss
    # a group of its own: a timed-out gloo pair is closed, and the harness's group must live on
    mesh = DeviceMesh.from_group(dist.new_group(list(range(dist.get_world_size()))), "cpu",
                                 mesh_dim_names=("pp",))
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case), **dict(case.options))
    message = ""
    if program.info.coords["pp"] == 1:
        message = _fails(lambda: _train(program, data[:1]), RuntimeCommError)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    return {"messages": gathered}


def collective_timeout(case, mesh) -> dict:
    """Rank 1 skips its step; rank 0 waits in a collective and must raise RuntimeCommError after
    ``p2p_timeout_s`` (2 s): the dp gradient all-reduce at dp=2, a tp all-reduce inside the forward
    at tp=2. Each on a group of the test's own (a timed-out group is unusable), made with a 20 s gloo
    timeout so the abandoned operation ends; a watchdog ends the worker if anything hangs."""
    import datetime
    import faulthandler
    import sys
    import time

    import torch.distributed as dist
    from autopar.errors import RuntimeCommError
    from torch.distributed.device_mesh import DeviceMesh
    import autopar
    from autopar.models import lm_loss
    faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)  # never a hang: the worker dies
    out = {}
    try:
        # "dp_grads": a loss that is no token mean (no count collective); rank 1 joins the batch agreement
        # and stops, so rank 0's gradient reduction is what times out
        for axis, loss_fn in (("dp", lm_loss), ("dp_grads", lambda out, t: lm_loss(out, t) * 1.0), ("tp", lm_loss)):
            group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=20))
            mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(axis[:2],))
            model = build(case)
            data = batches(case, model.cfg.vocab_size)
            program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=loss_fn,
                                      example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=2.0)
            message, seconds = "", 0.0
            if dist.get_rank() == 0:
                began = time.monotonic()
                message = _fails(lambda: _train(program, data[:1]), RuntimeCommError)
                seconds = time.monotonic() - began
            elif axis == "dp_grads":  # rank 1 joins the batch agreement, then stops before its schedule
                _stop_after_agreement(program, data[:1])
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (message, seconds))
            out[axis] = gathered
    finally:
        faulthandler.cancel_dump_traceback_later()
    return out


class _StoppedAfterAgreement(Exception):
    """Raised on purpose in place of a step's schedule (collective_timeout's dp_grads case)."""


def _stop_after_agreement(program, data) -> None:
    """Run a step up to and including the dp batch agreement, then stop: its peer's next dp collective is
    then the gradient reduction, which must time out by itself."""
    def refuse(*_args, **_kwargs):
        raise _StoppedAfterAgreement
    program.batching.schedule_for = refuse
    try:
        _train(program, data)
    except _StoppedAfterAgreement:
        return
    raise AssertionError("the step ran past its batch agreement")


# -- the spawned groups the checkpoint, fault and real-world-model tests share --------------------------
def reference_from(case, state: dict, first_step: int) -> dict:
    """One device from ``state`` with a fresh optimizer, steps ``first_step``.. of ``case``'s data."""
    from autopar.models import lm_loss
    model = build(case)
    model.load_state_dict(state)
    opt = make_optimizer(case)(list(model.parameters()))
    losses = []
    for x, y in batches(case, model.cfg.vocab_size)[first_step:]:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _with_spare(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a module and a buffer its forward never reads (as CLIP's vision
    ``post_layernorm`` under a loss on the hidden states): seeded values, built after the model."""
    model.spare = torch.nn.Linear(4, 3)
    model.register_buffer("spare_count", torch.tensor([3.0, 5.0]))
    return model


SPARE_KEYS = ("spare.weight", "spare.bias", "spare_count")


def unused_save(case, mesh) -> dict:
    """Tensors no graph reads: exported untrained after 2 steps, set by load_full_state_dict, saved;
    and a meta-built twin fills them with the model's own initialisers."""
    model = _with_spare(build(case))
    original = {k: v.detach().clone() for k, v in model.state_dict().items() if k in SPARE_KEYS}
    program, data = _compile(case, mesh, model=model)
    _train(program, data[:2])
    exported = program.full_state_dict()
    given = {**exported, "spare.weight": torch.full((3, 4), 0.5), "spare.bias": torch.arange(3.0),
             "spare_count": torch.tensor([7.0, 11.0])}
    program.load_full_state_dict(given)
    loaded = {k: v for k, v in program.full_state_dict().items() if k in SPARE_KEYS}
    program.save_checkpoint(_root(case))
    with torch.device("meta"):
        meta = build(case)  # (seeds 1234, as the real build above)
        meta.spare = torch.nn.Linear(4, 3)
    from_meta, _ = _compile(case, mesh, model=meta)
    return {"original": original, "exported": {k: exported.get(k) for k in SPARE_KEYS},
            "keys": sorted(exported), "model_keys": sorted(model.state_dict()), "loaded": loaded,
            "meta_spare": {k: v for k, v in from_meta.full_state_dict().items() if k.startswith("spare.")}}


def unused_resume(case, mesh) -> dict:
    """The checkpoint of :func:`unused_save`, loaded on another mesh into other values."""
    model = scrambled(_with_spare(build(case)))
    model.spare_count.zero_()
    program, _ = _compile(case, mesh, model=model)
    program.load_checkpoint(_root(case))
    return {"resumed": {k: v for k, v in program.full_state_dict().items() if k in SPARE_KEYS}}
