"""Faults injected into 2-rank gloo runs, for the job-wide diagnosis tests (tests/runtime/test_flight_faults.py).

:func:`launch` starts one world of ranks from the equivalence harness's fork server (torch and
autopar imported once) and supervises it as torchrun does: when a rank dies (SIGKILL, gloo's abort
on a collective mismatch), the others get SIGTERM, and SIGKILL 30 s later. Each rank runs the named
cases of this module one after another, each with ``run_dir=<root>/<case>`` and ``p2p_timeout_s``
2 s, on process groups of its own (a case that times out leaves its groups unusable), and saves
what it saw: its error's message, the stragglers of each step, the warnings logged. A fault case
whose culprit dies must run last in its world (it takes the world down). Nothing here can hang: every
rank has a watchdog (faulthandler) and the parent kills the world at its deadline.
"""
from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from equivalence import Case, _context, _free_port, batches, build, make_optimizer

CASE = Case(model="gpt_tiny", overrides=(("num_layers", 4),), steps=2)
TIMEOUT_S = 2.0  # p2p_timeout_s of every case
FAULT_STEP = 2  # the step (numbered from 1) in which the fault happens
VICTIM = "tp_reduce_1"  # the TpReduce node (the first block's MLP output) a tensor-parallel fault strikes


# -- the world -----------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _rank_main(rank: int, world: int, port: int, cases: list, root: str, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(150, exit=True)  # never a hang
    with open(os.path.join(root, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case in cases:
        result = globals()[case](rank, os.path.join(root, case))
        torch.save(result, os.path.join(root, f"{case}.rank{rank}.pt"))
        _wait_for_peers(rank, world, root, f"{case}.rank{{}}.pt")
    os._exit(0)  # no destroy_process_group: a case's groups may hold abandoned operations


def _wait_for_peers(rank: int, world: int, root: str, pattern: str) -> None:
    """Until every other rank has saved its result or died (rank 0 serves the store the others diagnose on)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        waiting = [r for r in range(world) if r != rank and not os.path.exists(os.path.join(root, pattern.format(r)))
                   and _alive(int(open(os.path.join(root, f"pid{r}")).read()))]
        if not waiting:
            return
        time.sleep(0.1)


def launch(cases: list[str], *, world: int = 2, timeout_s: float = 240) -> tuple[str, dict]:
    """Run ``cases`` (names of this module's runners) in one world; (root folder, {rank: exit code})."""
    root = tempfile.mkdtemp(prefix="autopar-flight-")
    ctx = _context()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cases, root, dict(os.environ)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline, stopped = time.monotonic() + timeout_s, None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if stopped is None and any(p.exitcode not in (None, 0) for p in procs):  # as torchrun: stop the rest
            stopped = time.monotonic()
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
        if stopped is not None and time.monotonic() - stopped > 30:
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return root, {r: p.exitcode for r, p in enumerate(procs)}


def result(root: str, case: str, rank: int) -> dict | None:
    path = os.path.join(root, f"{case}.rank{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def report(root: str, case: str) -> str:
    with open(os.path.join(root, case, "diagnosis.txt"), encoding="utf-8") as f:
        return f.read()


# -- building a case ---------------------------------------------------------------------------------------
def _program(axis: str, run_dir: str, **options):
    """gpt_tiny (4 layers) over a 1-D mesh on a group of its own (a 20 s gloo timeout ends what is abandoned)."""
    from torch.distributed.device_mesh import DeviceMesh

    import autopar
    from autopar.models import lm_loss
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=20))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(axis,))
    model = build(CASE)
    data = batches(CASE, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              optimizer=make_optimizer(CASE), p2p_timeout_s=TIMEOUT_S, run_dir=run_dir, **options)
    return program, data


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train(program, data) -> dict:
    """Train every step; the error's message (if any), each step's stragglers and the warnings logged."""
    from autopar.errors import RuntimeCommError
    caught = _Warnings()
    logging.getLogger("autopar").addHandler(caught)
    out = {"error": "", "stragglers": {}, "rank": dist.get_rank()}
    try:
        for x, y in data:
            program.train_step(program.shard_batch(x), target=program.shard_batch(y))
            out["stragglers"][program.step_count] = [s.__dict__ for s in program.stragglers]
    except RuntimeCommError as exc:
        out["error"] = str(exc)
    finally:
        logging.getLogger("autopar").removeHandler(caught)
    out["warnings"] = caught.messages
    report = program.watch.report
    out["reporter"] = None if report is None else report.reporter  # the rank that made the report this one logged
    return out


def _victim(program):
    """The TpReduce node VICTIM of the rank's stage graph."""
    return program.stages[0].gm.get_submodule(VICTIM)


def _sleep_in(module, program, seconds: float) -> None:
    """``module``'s first call in step FAULT_STEP sleeps ``seconds`` before it runs (inside the stage's forward)."""
    forward, calls = module.forward, []

    def slow(x):
        if program.step_count + 1 == FAULT_STEP and not calls:
            calls.append(1)
            time.sleep(seconds)
        return forward(x)

    module.forward = slow


# -- the cases: each returns what this rank saw ---------------------------------------------------------------
def stop_sending(rank: int, run_dir: str) -> dict:
    """pp=2, 1F1B over 4 microbatches: in step 2 rank 0 sends no activation from microbatch 2 on."""
    program, data = _program("pp", run_dir)
    if rank == 0:
        channel, send = program.channel, program.channel.send

        def dropping(tensor, *, stage, edge, microbatch, is_grad):
            if program.step_count + 1 == FAULT_STEP and not is_grad and microbatch >= 2:
                return None
            return send(tensor, stage=stage, edge=edge, microbatch=microbatch, is_grad=is_grad)

        channel.send = dropping
    return _train(program, data)


def straggler(rank: int, run_dir: str) -> dict:
    """tp=2: in step 2 rank 1 sleeps 0.8 s inside a forward's TpReduce (under p2p_timeout_s): the step ends."""
    program, data = _program("tp", run_dir)
    if rank == 1:
        _sleep_in(_victim(program), program, 0.8)
    return _train(program, data)


def sleeper(rank: int, run_dir: str) -> dict:
    """tp=2: in step 2 rank 1 sleeps 4 s inside a forward's TpReduce, past rank 0's p2p_timeout_s (2 s) and
    the second its diagnosis takes."""
    program, data = _program("tp", run_dir)
    if rank == 1:
        _sleep_in(_victim(program), program, 4.0)
    return _train(program, data)


def skip_all_reduce(rank: int, run_dir: str) -> dict:
    """tp=2: in step 2 rank 1 skips one TpReduce's all-reduce (the next ones pair off by one, and gloo
    aborts rank 1 where their sizes differ)."""
    program, data = _program("tp", run_dir)
    victim = _victim(program)
    if rank == 1:
        forward = victim.forward

        def skipping(x):
            if program.step_count + 1 == FAULT_STEP and not getattr(victim, "skipped", False):
                victim.skipped = True
                return x.clone()
            return forward(x)

        victim.forward = skipping
    return _train(program, data)


def killed(rank: int, run_dir: str) -> dict:
    """pp=2, 1F1B: in step 2 rank 1 kills itself with SIGKILL inside its forward of microbatch 2."""
    program, data = _program("pp", run_dir)
    if rank == 1:
        stage = program.stages[1].gm
        forward = stage.forward

        def dying(*args, **kwargs):
            if program.step_count + 1 == FAULT_STEP and program.channel.microbatch == 2:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return forward(*args, **kwargs)

        stage.forward = dying
    return _train(program, data)
