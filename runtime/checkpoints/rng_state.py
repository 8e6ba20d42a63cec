"""Each rank's random state in a checkpoint: restored 1:1 on the same mesh, re-derived on another.

A rank draws dropout masks from three places, all of which a checkpoint keeps, per rank:

- torch's default CPU generator (random ops in replicated regions, every op of a dp or pp rank);
- the CUDA generators, one per visible device, when CUDA has been initialised;
- its tensor-parallel trackers (:class:`autopar.ops.tp_rng.TpRngTracker`, one per stage
  graph with sharded random ops), each a CPU state and, on CUDA, a CUDA state.

**The same mesh** (same dp, cp, pp, tp degrees and world size): rank r gets back exactly the states
rank r saved, so a resumed run draws the masks the run that never stopped would have drawn, and
trains bit for bit like it.

**Another mesh**: the saved states cannot map 1:1 (rank r of the new mesh holds other stages and
other shards than the saving rank r did, and there may be more or fewer ranks). Every rank then
seeds its default CPU and CUDA generators with :func:`derived_seed` of (the saving rank 0's
initial seed, the checkpoint's step), the same number on every rank, as a fresh start with one
``torch.manual_seed`` on every process would; and each tp tracker with
``tp_rng_seed(derived, tp_rank)``, as :mod:`autopar.passes.tp.tp_random` seeds it at compile time.
So replicated regions still draw alike on every tp rank, sharded regions still draw per tp rank,
and resuming one checkpoint on one mesh always draws the same masks. It is logged (INFO) on
rank 0. The masks differ from those of the run that never stopped: no layout of the saved
streams could reproduce them on other stage and shard boundaries.
"""
from __future__ import annotations

import hashlib
import logging

import torch

from autopar.ops.tp_rng import TpRngTracker, tp_rng_seed
from autopar.runtime.execution.rank_context import ProgramState

__all__ = ["random_pieces", "restore_random", "reseed_random", "derived_seed", "same_layout", "rng_manifest"]

log = logging.getLogger(__name__)


def _trackers(program: ProgramState) -> list[TpRngTracker]:
    """This rank's tp trackers, in stage order (one per stage graph that has sharded random ops)."""
    found, seen = [], set()
    for _, stage in sorted(program.stages.items()):
        for module in stage.gm.modules():
            tracker = getattr(module, "tracker", None)
            if isinstance(tracker, TpRngTracker) and id(tracker) not in seen:
                seen.add(id(tracker))
                found.append(tracker)
    return found


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def random_pieces(program: ProgramState, rank: int) -> dict[str, torch.Tensor]:
    """``{checkpoint key: state}`` of this rank's generators (keys ``rng/rank<r>/...``)."""
    base = f"rng/rank{rank}"
    pieces = {f"{base}/cpu": torch.get_rng_state()}
    if _cuda_in_use():
        for device, state in enumerate(torch.cuda.get_rng_state_all()):
            pieces[f"{base}/cuda{device}"] = state
    for i, tracker in enumerate(_trackers(program)):
        pieces[f"{base}/tp{i}/cpu"] = tracker.cpu_state.clone()
        if tracker.cuda_state is not None:
            pieces[f"{base}/tp{i}/cuda"] = tracker.cuda_state.clone()
    return pieces


def rng_manifest(program: ProgramState, world_size: int) -> dict:
    """What a load needs to decide between restoring and re-deriving (rank 0's view)."""
    mesh = program.plan.mesh
    return {"seed": int(torch.initial_seed()), "world_size": world_size,
            "mesh": [mesh.dp, mesh.pp, mesh.tp], "cp": mesh.cp}


def same_layout(saved: dict | None, program: ProgramState, world_size: int) -> bool:
    """Whether the saved per-rank states map 1:1 onto this job's ranks (a checkpoint from before cp has none: 1)."""
    mesh = program.plan.mesh
    return (bool(saved) and saved.get("world_size") == world_size and saved.get("mesh") == [mesh.dp, mesh.pp, mesh.tp]
            and saved.get("cp", 1) == mesh.cp)


def restore_random(program: ProgramState, pieces: dict[str, torch.Tensor], rank: int) -> None:
    """Put back this rank's saved generator states (``pieces`` as :func:`random_pieces` named them)."""
    base = f"rng/rank{rank}"
    torch.set_rng_state(pieces[f"{base}/cpu"])
    cuda = sorted(k for k in pieces if k.startswith(f"{base}/cuda"))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([pieces[f"{base}/cuda{d}"] for d in range(len(cuda))])
    for i, tracker in enumerate(_trackers(program)):
        if f"{base}/tp{i}/cpu" not in pieces:  # the same mesh under another plan: this stream is new
            log.warning("rank %d: no saved state for tensor-parallel stream %d; it starts from its seed", rank, i)
            continue
        tracker.cpu_state = pieces[f"{base}/tp{i}/cpu"].clone()
        tracker.cuda_state = pieces[f"{base}/tp{i}/cuda"].clone() if f"{base}/tp{i}/cuda" in pieces else None


def derived_seed(seed: int, step: int) -> int:
    """A seed for resuming at ``step`` on another mesh: a fixed function of the saved seed and step."""
    digest = hashlib.sha256(f"autopar-rng:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are < 2**64; keep it positive


def reseed_random(program: ProgramState, *, seed: int, step: int, tp_rank: int) -> int:
    """Seed every generator of this rank from ``derived_seed(seed, step)`` (see the module doc); returns it."""
    new = derived_seed(seed, step)
    torch.manual_seed(new)  # the CPU generator and, when CUDA is there, every device's
    for tracker in _trackers(program):
        tracker.seed = tp_rng_seed(new, tp_rank)
        tracker.cpu_state = torch.Generator().manual_seed(tracker.seed).get_state()
        tracker.cuda_state = None  # TpRngTracker.fork seeds CUDA from tracker.seed when it next runs
    return new
