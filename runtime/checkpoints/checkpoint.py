"""Checkpoints that reshard: save on one mesh, load on another, train on as if never stopped.

``save_checkpoint(program, root)`` writes, with ``torch.distributed.checkpoint`` (DCP), the pieces
this rank holds of every weight, buffer and optimizer state tensor, under the single-device names
(``user_name``), plus a manifest (layouts, checksums, the step counter, the optimizer's
hyper-parameters); see :mod:`autopar.runtime.checkpoints.checkpoint_layout` for the pieces and
:mod:`autopar.runtime.checkpoints.checkpoint_files` for the atomic publish. Replicated pieces (dp copies,
tied weights, tp-replicated weights) are one DCP key, so DCP writes them once.

``load_checkpoint(program, path)`` checks the checkpoint against the program first (names and
shapes: :class:`autopar.CheckpointError` naming the keys), reads the pieces of the saved layout,
verifies their checksums, joins them and cuts this rank's pieces for *its* layout, so a checkpoint
saved at pp=2, tp=2 loads at dp=4, pp=4, tp=2 or one device. Optimizer state follows each
parameter by name to whichever dp rank steps it now (:class:`~autopar.runtime.state.zero.ShardedOptimizer`).
Nothing is changed until every check has passed on every rank.

``load_full_state_dict(program, sd)`` starts from a single-device ``state_dict``.
Every function here is collective: every rank of the job calls it.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from autopar.errors import CheckpointError
from autopar.runtime.checkpoints import checkpoint_files as files
from autopar.runtime.checkpoints.checkpoint_extra import check_extra, read_extra, restore_extra, write_extra
from autopar.runtime.checkpoints.checkpoint_layout import Layout, join, split
from autopar.runtime.state.rank_tensors import Held, held_tensors
from autopar.runtime.checkpoints import rng_state
from autopar.runtime.execution.rank_context import ProgramState

__all__ = ["save_checkpoint", "load_checkpoint", "load_full_state_dict", "agree_on_error"]

log = logging.getLogger(__name__)


# -- agreeing on errors ---------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_on_error(error: CheckpointError | None) -> None:
    """Raise on every rank if any rank found an error (so no rank waits for the others in vain)."""
    if _distributed():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else (error.what, error.where, error.fix))
        first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if first is None:
            return
        rank, (what, where, fix) = first
        raise CheckpointError(what, where=f"rank {rank}: {where}" if where else f"rank {rank}", fix=fix)
    if error is not None:
        raise error


def _dcp():
    """torch.distributed.checkpoint, imported on first use: it pulls in DTensor (half a second), which
    a program that never saves or loads does not need."""
    import torch.distributed.checkpoint as dcp
    return dcp


def _dcp_failure() -> type[BaseException]:
    """DCP's CheckpointException, a BaseException rather than an Exception."""
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def _cause(exc: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException carries each rank's traceback: its last line."""
    CheckpointException = _dcp_failure()
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[-1] if isinstance(exc, CheckpointException) and lines else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text[:300]}" if not isinstance(exc, CheckpointException) else text[:300]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# -- saving -----------------------------------------------------------------------------------------
def _entry(held_layout: Layout, kind: str, dtype: torch.dtype, aliases=()) -> dict:
    return {"layout": held_layout.to_json(), "kind": kind, "dtype": str(dtype).removeprefix("torch."),
            "aliases": list(aliases), "checksums": {}}


def _optimizer_pieces(program: ProgramState, by_name: dict[str, Held], state: dict, entries: dict) -> None:
    """Add the optimizer state of the parameters this rank steps (keys ``optim/<name>/<state>``)."""
    for name, values in program.optimizer.named_state().items():
        held = by_name[name]
        for key, value in values.items():
            base = f"optim/{held.name}/{key}"
            if not isinstance(value, torch.Tensor):
                entries[base] = {"kind": "number", "value": value}
                continue
            value = value.detach()
            if tuple(value.shape) == tuple(held.tensor.shape) and value.dim() > 0:
                layout, kind, piece = held.layout, "like_param", held.piece(base)
            elif value.dim() == 0:
                layout, kind, piece = Layout(shape=()), "scalar", base
            else:  # a state whose shape depends on this rank's cut (factored second moments)
                layout, kind = Layout(shape=tuple(value.shape)), "opaque"
                piece = held.own_piece(base)
                entries.setdefault(base, _entry(layout, kind, value.dtype))["of"] = held.layout.to_json()
            entries.setdefault(base, _entry(layout, kind, value.dtype))["checksums"][piece] = files.checksum(value)
            state[piece] = value


def _pieces_to_save(program: ProgramState) -> tuple[dict, dict]:
    """(DCP state dict of this rank's pieces, manifest entries with their checksums)."""
    state, entries, by_name = {}, {}, {}
    for held in held_tensors(program):
        by_name.update({alias: held for alias in held.aliases})
        base = f"model/{held.name}"
        piece = held.piece(base)
        value = held.tensor.detach()
        entry = entries.setdefault(base, _entry(held.layout, held.kind, value.dtype, held.aliases))
        entry["checksums"][piece] = files.checksum(value)
        state[piece] = value
    _optimizer_pieces(program, by_name, state, entries)
    for key, value in rng_state.random_pieces(program, _rank()).items():  # this rank's generators
        entries[key] = {**_entry(Layout(shape=tuple(value.shape)), "rng", value.dtype),
                        "checksums": {key: files.checksum(value)}}
        state[key] = value
    return state, entries


def _merge(parts: list[dict]) -> dict:
    merged: dict = {}
    for part in parts:
        for base, entry in part.items():
            if base not in merged:
                merged[base] = entry
            elif "checksums" in entry:
                merged[base]["checksums"].update(entry["checksums"])
    return merged


def _gather(obj) -> list:
    if not _distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _manifest(program: ProgramState, parts: list, extra: dict | None) -> dict:
    groups = next((g for _, g in parts if g), [])  # the same on every rank (runtime/state/param_groups.py)
    return {"format": files.FORMAT, "step": program.step_count, "model": program.plan.model_name,
            "mesh": program.plan.mesh.model_dump(), "plan": program.plan.model_dump_json(),
            "optimizer_groups": groups, "tensors": _merge([e for e, _ in parts]),
            "rng": rng_state.rng_manifest(program, _world()), "extra": extra}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def save_checkpoint(program: ProgramState, root: str, *, extra=None) -> str:
    """Save ``program`` (weights, buffers, optimizer state and groups, step) and the states of the ``extra``
    objects (runtime/checkpoints/checkpoint_extra.py) under ``root``; returns the step folder."""
    extra = check_extra(extra, where="save_checkpoint(extra=...)")
    step, rank = program.step_count, _rank()
    tmp = files.tmp_dir_for(root, step)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        files.remove_quietly(tmp)
    _barrier()
    state, entries = _pieces_to_save(program)
    error = None
    dcp = _dcp()
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    except (Exception, _dcp_failure()) as exc:  # noqa: BLE001 - any writer failure: the previous checkpoint stays
        error = CheckpointError(f"saving step {step} failed: {_cause(exc)}",
                                where=tmp, fix="check the disk (space, permissions); the previous "
                                               "checkpoint under the root is intact")
    parts = _gather((entries, _jsonable(program.optimizer.hyperparameters())))
    final = os.path.join(root, files.step_dir_name(step))
    if rank == 0 and error is None:
        try:
            files.write_manifest(tmp, _manifest(program, parts, write_extra(tmp, extra)))
            files.publish(tmp, root, step)
        except Exception as exc:  # noqa: BLE001
            error = CheckpointError(f"publishing step {step} failed: {exc}", where=final,
                                    fix="check the disk; the previous checkpoint under the root is intact")
    if error is not None and rank == 0:
        files.remove_quietly(tmp)
    agree_on_error(error)
    log.info("saved step %d to %s", step, final)
    return final


def _jsonable(groups: list[dict]) -> list[dict]:
    """The optimizer's hyper-parameters that JSON can hold (others are left to the optimizer factory)."""
    out = []
    for group in groups:
        kept = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:  # a tensor learning rate
                value = value.item()
            if isinstance(value, (bool, int, float, str, type(None))) or (
                    isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value)):
                kept[key] = list(value) if isinstance(value, tuple) else value
        out.append(kept)
    return out


# -- loading ----------------------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _check_fits(program: ProgramState, manifest: dict, held: list[Held]) -> CheckpointError | None:
    """Names and shapes of the checkpoint against the program (every rank checks what it holds)."""
    saved = {b.removeprefix("model/"): e for b, e in manifest["tensors"].items() if b.startswith("model/")}
    saved_names = {a for name, e in saved.items() for a in (e.get("aliases") or [name])}
    missing = sorted({h.name for h in held if not saved_names.intersection(h.aliases)})
    unexpected = sorted(saved_names - set(program.state_keys))
    wrong = []
    for h in held:
        entry = next((saved[a] for a in h.aliases if a in saved), None)
        if entry is not None and tuple(entry["layout"]["shape"]) != h.layout.shape:
            wrong.append(f"{h.name}: checkpoint {tuple(entry['layout']['shape'])} vs model {h.layout.shape}")
    if not (missing or unexpected or wrong):
        return None
    parts = []
    if missing:
        parts.append(f"missing keys {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        parts.append(f"unexpected keys {unexpected[:8]}"
                     + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    if wrong:
        parts.append(f"shape mismatches {wrong[:8]}")
    return CheckpointError(f"the checkpoint (model {manifest.get('model')}) does not fit this model "
                           f"({program.plan.model_name}): " + "; ".join(parts),
                           where="load_checkpoint", fix="load a checkpoint saved from the same model "
                                                        "(configuration and parameter names)")


def _find(manifest: dict, base_names) -> tuple[str, dict] | None:
    for base in base_names:
        if base in manifest["tensors"]:
            return base, manifest["tensors"][base]
    return None


def _request(program: ProgramState, manifest: dict, held: list[Held]) -> tuple[dict, dict, dict]:
    """(DCP request of the pieces to read, {held name: (base, entry)}, {param: {state: (base, entry)}})."""
    request: dict = {}

    def want(base: str, entry: dict, keys) -> None:
        layout = Layout.from_json(entry["layout"])
        for key in keys:
            request[key] = torch.empty(layout.piece_shape(), dtype=_dtype(entry["dtype"]), device="cpu")  # host staging

    params = {}
    for h in held:
        base, entry = _find(manifest, [f"model/{a}" for a in h.aliases])
        params[h.name] = (base, entry)
        want(base, entry, [k for k, _, _ in Layout.from_json(entry["layout"]).pieces(base)])
    states: dict = {}
    by_alias = {a: h for h in held for a in h.aliases}
    for name in program.optimizer.stepped_names():
        h = by_alias[name]
        prefix = f"optim/{_find(manifest, [f'model/{a}' for a in h.aliases])[0].removeprefix('model/')}/"
        for base, entry in manifest["tensors"].items():
            if not base.startswith(prefix):
                continue
            states.setdefault(name, {})[base[len(prefix):]] = (base, entry)
            if entry["kind"] == "like_param":
                want(base, entry, [k for k, _, _ in Layout.from_json(entry["layout"]).pieces(base)])
            elif entry["kind"] == "scalar":
                want(base, entry, [base])
            elif entry["kind"] == "opaque":
                if Layout.from_json(entry["of"]) != h.layout:
                    raise _opaque_error(base, entry, h)
                want(base, entry, [h.own_piece(base)])
    if rng_state.same_layout(manifest.get("rng"), program, _world()):  # else re-derived: rng_state.py
        mine = f"rng/rank{_rank()}/"
        for base, entry in manifest["tensors"].items():
            if base.startswith(mine):
                want(base, entry, [base])
    return request, params, states


def _random(program: ProgramState, manifest: dict, request: dict) -> None:
    """Restore this rank's generators (same mesh) or re-derive them (another mesh); rng_state.py."""
    saved = manifest.get("rng")
    if not saved:
        log.warning("the checkpoint holds no random state (saved by an older autopar): the generators are "
                    "left as they are")
    elif rng_state.same_layout(saved, program, _world()):
        rng_state.restore_random(program, {k: v for k, v in request.items() if k.startswith("rng/")}, _rank())
    else:
        seed = rng_state.reseed_random(program, seed=saved["seed"], step=int(manifest["step"]),
                                       tp_rank=program.info.coords["tp"])
        if _rank() == 0:
            mesh = program.plan.mesh
            log.info("random state: saved on mesh (dp, pp, tp) = %s%s over %s ranks, loaded on %s%s over %s: the "
                     "per-rank generators cannot map 1:1, so every rank is re-seeded from seed %s and step %s "
                     "(derived seed %d)", tuple(saved["mesh"]), _cp_text(saved.get("cp", 1)), saved["world_size"],
                     (mesh.dp, mesh.pp, mesh.tp), _cp_text(mesh.cp), _world(), saved["seed"], manifest["step"], seed)


def _cp_text(cp: int) -> str:
    return f" with cp={cp}" if cp > 1 else ""


def _opaque_error(base: str, entry: dict, held: Held) -> CheckpointError:
    return CheckpointError(f"optimizer state {base} has a shape tied to the saving rank's cut "
                           f"({entry['of']}), which differs here ({held.layout.to_json()})",
                           where="load_checkpoint",
                           fix="load it on a mesh with the same tp degree and ZeRO stage, or load the weights "
                               "only with load_full_state_dict and start the optimizer afresh")


def _check_index(folder: str, request: dict) -> CheckpointError | None:
    """DCP's index must unpickle, list every requested piece, and point inside files that exist."""
    fix = "load an earlier checkpoint (the root's other step_… folders)"
    try:
        metadata = _dcp().FileSystemReader(folder).read_metadata()
        storage = metadata.storage_data
        sizes: dict[str, int] = {}
        for index, info in storage.items():
            if index.fqn in request:
                path = os.path.join(folder, info.relative_path)
                sizes.setdefault(path, os.path.getsize(path))
                if info.offset + info.length > sizes[path]:
                    return CheckpointError(f"{info.relative_path} is truncated: piece {index.fqn} ends at byte "
                                           f"{info.offset + info.length} of {sizes[path]}", where=folder, fix=fix)
        listed = {index.fqn for index in storage}
    except Exception as exc:  # noqa: BLE001 - an unreadable index or a missing data file
        return CheckpointError(f"the checkpoint index is corrupted or incomplete: {_cause(exc)}", where=folder,
                               fix=fix)
    absent = sorted(set(request) - listed)
    if absent:
        return CheckpointError(f"the checkpoint index lacks {len(absent)} piece(s), e.g. {absent[:4]}",
                               where=folder, fix=fix)
    return None


def _read(folder: str, request: dict, manifest: dict) -> CheckpointError | None:
    """Read every requested piece and verify its checksum."""
    dcp = _dcp()
    try:
        dcp.load(request, storage_reader=dcp.FileSystemReader(folder))
    except (Exception, _dcp_failure()) as exc:  # noqa: BLE001 - DCP's own errors on a damaged file
        return CheckpointError(f"the checkpoint files are corrupted or incomplete: {_cause(exc)}",
                               where=folder, fix="load an earlier checkpoint (the root's other step_… folders)")
    sums = {k: s for e in manifest["tensors"].values() for k, s in (e.get("checksums") or {}).items()}
    bad = sorted(k for k, t in request.items() if sums.get(k) != files.checksum(t))
    if bad:
        return CheckpointError(f"checksum mismatch in {len(bad)} piece(s), e.g. {bad[:4]}: the files are corrupted",
                               where=folder, fix="load an earlier checkpoint (the root's other step_… folders)")
    return None


def _cut(full: torch.Tensor, h: Held) -> torch.Tensor:
    return split(full, h.layout, tp_index=h.tp_index, z_index=h.z_index, ep_index=h.ep_index)


def _apply(program: ProgramState, manifest: dict, held: list[Held], request: dict, params: dict, states: dict) -> None:
    with torch.no_grad():
        for h in held:
            base, entry = params[h.name]
            full = join(request, Layout.from_json(entry["layout"]), base)
            h.tensor.copy_(_cut(full.to(h.tensor.dtype), h))
        by_alias = {a: h for h in held for a in h.aliases}
        named: dict = {}
        for name, values in states.items():
            h = by_alias[name]
            for key, (base, entry) in values.items():
                if entry["kind"] == "number":
                    named.setdefault(name, {})[key] = entry["value"]
                elif entry["kind"] == "scalar":
                    named.setdefault(name, {})[key] = request[base].clone()
                elif entry["kind"] == "opaque":
                    named.setdefault(name, {})[key] = request[h.own_piece(base)].clone()
                else:
                    named.setdefault(name, {})[key] = _cut(join(request, Layout.from_json(entry["layout"]), base), h)
    program.optimizer.load_named_state(named, manifest.get("optimizer_groups") or None)
    program.step_count = int(manifest["step"])


def _check_groups(program: ProgramState, manifest: dict) -> CheckpointError | None:
    """The optimizer's parameter groups must be as many as the saving run's (their settings come back)."""
    saved, here = manifest.get("optimizer_groups") or [], program.optimizer.hyperparameters()
    if not saved or len(saved) == len(here):
        return None
    return CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter group(s), this program's "
                           f"{len(here)}: their settings (lr, weight decay, ...) cannot be restored",
                           where="load_checkpoint", fix="build the optimizer with the parameter groups of the run "
                                                       "that saved (the same factory and optimizer_params)")


def load_checkpoint(program: ProgramState, path: str, *, extra=None) -> int:
    """Load a checkpoint (a root's latest, or one step folder) into ``program``, and the states of the ``extra``
    objects; returns its step."""
    files.check_checkpoint_path(path)  # a str or os.PathLike (runtime/checkpoints/checkpoint_files.py)
    extra = check_extra(extra, where="load_checkpoint(extra=...)")
    folder = manifest = None
    error = None
    try:
        folder = files.resolve(path)
        manifest = files.read_manifest(folder)
    except CheckpointError as exc:
        error = exc
    agree_on_error(error)
    held = held_tensors(program)
    agree_on_error(_check_fits(program, manifest, held))
    agree_on_error(_check_groups(program, manifest))
    extra_states, error = read_extra(folder, manifest, extra)
    agree_on_error(error)
    try:
        request, params, states = _request(program, manifest, held)
    except CheckpointError as exc:
        error, request = exc, {}
    except (KeyError, TypeError, ValueError) as exc:
        error, request = CheckpointError(f"the manifest of {folder} is corrupted: {type(exc).__name__}: {exc}",
                                         where=folder, fix="load an earlier checkpoint"), {}
    agree_on_error(error)
    agree_on_error(_check_index(folder, request))
    agree_on_error(_read(folder, request, manifest))
    _apply(program, manifest, held, request, params, states)
    _random(program, manifest, request)
    restore_extra(extra, extra_states)  # after the optimizer's groups: a scheduler's state over their lrs
    _barrier()
    log.info("loaded step %s from %s", manifest["step"], folder)
    return program.step_count


# -- single-device state dicts ------------------------------------------------------------------------
def load_full_state_dict(program: ProgramState, state_dict: dict) -> None:
    """Set the weights (and buffers) from a single-device ``state_dict``; the optimizer is left as it is."""
    files.check_state_dict(state_dict)  # a mapping of str -> tensor (runtime/checkpoints/checkpoint_files.py)
    held = held_tensors(program)
    missing = sorted(h.name for h in held if not any(a in state_dict for a in h.aliases))
    unexpected = sorted(set(state_dict) - set(program.state_keys))
    given = {h.name: next((state_dict[a] for a in h.aliases if a in state_dict), None) for h in held}
    wrong = [f"{h.name}: state_dict {tuple(given[h.name].shape)} vs model {h.layout.shape}" for h in held
             if given[h.name] is not None and tuple(given[h.name].shape) != h.layout.shape]
    error = None
    if missing or unexpected or wrong:
        error = CheckpointError(f"the state_dict does not fit this model ({program.plan.model_name}): "
                                f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]}, "
                                f"shape mismatches {wrong[:8]}", where="load_full_state_dict",
                                fix="pass the state_dict of the same model (model.state_dict())")
    agree_on_error(error)
    with torch.no_grad():
        for h in held:
            h.tensor.copy_(_cut(given[h.name].detach().to("cpu", h.tensor.dtype), h))
