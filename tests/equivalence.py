"""The one equivalence harness: a strategy trains like a single device, or the test fails.

:func:`run_cases` starts one process group of ``world_size`` gloo ranks and runs many cases in
it. The ranks are forked from a fork server that has imported torch, its export stack and autopar
once per pytest session (a spawned rank spends about 3 s importing them before its first case);
each rank takes the parent's environment of the moment it starts. Each :class:`Case` trains the
same model, data and seed for a few optimizer steps with ``autopar.compile`` on its mesh;
:func:`reference_run` does the same on one device. :func:`assert_equivalent` compares losses and every parameter (fp32, relative 1e-5).

Every rank is judged, not rank 0 alone: each rank saves its own outcome, and :func:`run_cases`
returns rank 0's result with an ``"error"`` when any rank raised, when a rank's losses or gathered full state
dict differ from rank 0's (also inside a nested dict of results, such as a second program's), or when a dp replica's weights (``"replica"``: the compute parameters a rank holds whole)
differ from those of the dp-index-0 rank with the same (pp, tp) coordinates. Replicas must agree
bitwise: their gradients come from one all-reduce (or one owner's broadcast), and every rank steps
the same values. The full state dict is rebuilt from dp index 0's shards only, so without this a
wrong weight on another replica would go unseen. ``result["rank_results"]`` holds every rank's outcome.

The optimizer is SGD with momentum: its update is linear in the gradient, so a parallel run's
rounding differences (sums taken in another order) stay at rounding size. Adam divides each
gradient by its own running magnitude, which turns the rounding noise of a near-zero gradient
(an embedding row no token used) into an O(lr) step: no fp32 tolerance could judge it.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RTOL = 1e-5
ATOL = 1e-6  # absolute floor for parameters near zero, ~fp32 rounding of O(0.1) weights


@dataclass(frozen=True)
class Case:
    """One strategy to judge: model, mesh (dp, pp, tp) and compile options."""

    model: str = "gpt_tiny"
    mesh: tuple[int, int, int] = (1, 1, 1)
    options: tuple = ()  # (key, value) pairs passed to autopar.compile
    steps: int = 3
    batch: int = 8
    seq: int = 16
    lr: float = 0.05
    optimizer: str = "sgd"
    kind: str = "train"  # "train": losses and weights; "infer": forward outputs (no loss_fn)
    overrides: tuple = ()  # (field, value) pairs for the model config, e.g. (("num_layers", 4),)
    extra: tuple = ()  # (key, value) pairs a runner kind reads for itself (not passed to compile)
    cp: int = 1  # context parallelism: a cp mesh dim inside dp (docs/context_parallel.md)

    @property
    def world_size(self) -> int:
        return self.mesh[0] * self.mesh[1] * self.mesh[2] * self.cp

    def device_mesh(self):
        """This case's DeviceMesh over the world (the cp dim only when cp > 1, as autopar.init_mesh builds it)."""
        from torch.distributed.device_mesh import init_device_mesh
        if self.cp == 1:
            return init_device_mesh("cpu", self.mesh, mesh_dim_names=("dp", "pp", "tp"))
        return init_device_mesh("cpu", (self.mesh[0], self.cp, self.mesh[1], self.mesh[2]),
                                mesh_dim_names=("dp", "cp", "pp", "tp"))

    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        over = ",".join(f"{k}={v}" for k, v in self.overrides)
        return (f"{self.kind}-{self.model}-dp{self.mesh[0]}" + (f"cp{self.cp}" if self.cp > 1 else "")
                + f"pp{self.mesh[1]}tp{self.mesh[2]}"
                + (f"-{opts}" if opts else "") + (f"-{over}" if over else "")
                + ("-" + ",".join(f"{k}={v}" for k, v in self.extra) if self.extra else ""))


def build(case: Case):
    from autopar.models import build_model
    torch.manual_seed(1234)
    if case.model.startswith("hf_"):  # a transformers family (autopar.models.hf)
        from autopar.models.hf import build_hf_model
        return build_hf_model(case.model, **{"seq_len": max(case.seq, 16), **dict(case.overrides)})
    return build_model(case.model, **{"seq_len": max(case.seq, 16), **dict(case.overrides)})


def scrambled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with other weights (seeded): what a checkpoint load must overwrite."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def make_optimizer(case: Case):
    if case.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=case.lr, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=case.lr, weight_decay=0.01)


def batches(case: Case, vocab: int):
    g = torch.Generator().manual_seed(99)
    if case.model.startswith("hf_"):  # token ids, or images and labels for the vision families
        from autopar.models.hf import hf_batch
        return [hf_batch(case.model, batch=case.batch, seq=case.seq, vocab=vocab, generator=g)
                for _ in range(case.steps)]
    out = [(torch.randint(0, vocab, (case.batch, case.seq), generator=g),
            torch.randint(0, vocab, (case.batch, case.seq), generator=g)) for _ in range(case.steps)]
    if dict(case.extra).get("padded_targets"):
        for _, target in out:
            pad_targets(target)
    return out


def pad_targets(target: torch.Tensor) -> torch.Tensor:
    """Row r of ``target`` (batch b, sequence s) ends in r / (b - 1) of the row as -100 padding, in place:
    later rows, microbatches and dp ranks hold fewer counted tokens (all but one of the last row)."""
    batch, seq = target.shape
    for r in range(batch):
        target[r, seq - (r * (seq - 1)) // max(batch - 1, 1):] = -100
    return target


def reference_run(case: Case) -> dict:
    """Single-device training: losses per step and the final state_dict."""
    from autopar.models import lm_loss
    model = build(case)
    opt = make_optimizer(case)(list(model.parameters()))
    losses = []
    for idx, tgt in batches(case, model.cfg.vocab_size):
        opt.zero_grad()
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        if dict(case.options).get("max_grad_norm"):  # torch's clipping is the reference for autopar's
            torch.nn.utils.clip_grad_norm_(model.parameters(), dict(case.options)["max_grad_norm"])
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def parallel_run(case: Case, mesh) -> dict:
    """This rank's run of ``case`` under autopar: losses and full state (compared with one device), and
    the replica record that :func:`judge_ranks` compares across dp replicas."""
    import autopar
    from autopar.models import lm_loss
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case),
                              p2p_timeout_s=120, **dict(case.options))
    losses = []
    for idx, tgt in data:
        loss = program.train_step(program.shard_batch(idx), target=program.shard_batch(tgt))
        losses.append(loss.item())
    state = program.full_state_dict()
    return {"losses": losses, "state": state, "plan": program.plan.model_dump_json(),
            "optimizer_state_bytes": program.optimizer.local_state_bytes(), **replica_record(program)}


def replica_record(program) -> dict:
    """This rank's coordinates and the compute parameters it holds whole (ZeRO-3's 1/N shards left out:
    those differ by design, and the full state dict gathers every one of them), for the replica check."""
    from autopar.ops.zero3_ops import zero3_targets
    replica = {}
    if program.plan.data_parallel == "dataparallel":  # rank 0 alone steps; the others receive its weights at
        return {"coords": dict(program.info.coords), "replica": replica}  # the next step's start (stale until then)
    for stage in program.stages.values():
        sharded = set(zero3_targets(stage.gm))
        replica.update({f"stage{stage.stage}.{name}": p.detach().clone()
                        for name, p in stage.gm.named_parameters(remove_duplicate=False) if name not in sharded})
    return {"coords": dict(program.info.coords), "replica": replica}


def inference_run(case: Case, mesh) -> dict:
    """Forward only: compile without a loss and return this rank's outputs for each batch."""
    import autopar
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), p2p_timeout_s=120,
                              **dict(case.options))
    outputs = [program(program.shard_batch(idx)) for idx, _ in data]
    return {"outputs": outputs, "dp_index": program.info.coords["dp"], **replica_record(program)}


def reference_outputs(case: Case) -> list:
    model = build(case)
    with torch.no_grad():
        return [model(idx) for idx, _ in batches(case, model.cfg.vocab_size)]


_RUNNERS = {"train": parallel_run, "infer": inference_run}


def _runner(kind: str):
    """A registered kind, or ``"module:function"`` imported in the worker (tests/ is on its path)."""
    if kind in _RUNNERS:
        return _RUNNERS[kind]
    import importlib
    module, _, function = kind.partition(":")
    return getattr(importlib.import_module(module), function)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the fork server: what every rank needs before its first case (the export stack is
# imported lazily by torch.export's first call, half of a rank's start-up)
_PRELOAD = ("torch", "torch.distributed", "torch.export", "torch._dynamo", "torch._functorch.aot_autograd",
            "torch.fx.experimental.proxy_tensor", "torch.fx.experimental.symbolic_shapes", "autopar",
            "autopar.models", "equivalence")


def _context():
    """The fork-server context, its preload set (multiprocessing starts the server on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _worker(rank: int, world: int, port: int, cases: list, out_dir: str, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the parent's now, not the fork server's from when it started
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            mesh = case.device_mesh()
            try:
                result = _runner(case.kind)(case, mesh)
            except Exception as exc:  # report per case, keep the group going
                import traceback
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            torch.save(result, os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_cases(cases: list[Case], *, timeout_s: float = 600) -> list[dict]:
    """Run every case (all of one world size) in one spawned process group; rank 0's results, each
    judged against every rank's (:func:`judge_ranks`)."""
    world = cases[0].world_size
    assert all(c.world_size == world for c in cases)
    with tempfile.TemporaryDirectory() as out_dir:
        _context()
        ctx = mp.start_processes(_worker, args=(world, _free_port(), cases, out_dir, dict(os.environ)),
                                 nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"cases {[c.name() for c in cases]} did not finish in {timeout_s}s")
        return [judge_ranks([torch.load(os.path.join(out_dir, f"case{i}_rank{r}.pt"), weights_only=False)
                             for r in range(world)]) for i in range(len(cases))]


def _same_answer(rank: int, mine: dict, first: dict) -> str | None:
    """What differs between two ranks' copies of one answer: the step losses, or the full state dict every
    rank gathers (bitwise: one all-gather of the same shards)."""
    if "losses" in mine and "losses" in first and mine["losses"] != first["losses"]:
        return f"rank {rank} reports losses {mine['losses']}, rank 0 {first['losses']}"
    if isinstance(mine.get("state"), dict) and isinstance(first.get("state"), dict):
        if set(mine["state"]) != set(first["state"]):
            return f"rank {rank}'s full state has keys {sorted(set(mine['state']) ^ set(first['state']))} rank 0's has not"
        for key, value in mine["state"].items():
            theirs = first["state"][key]
            if not (isinstance(value, torch.Tensor) and isinstance(theirs, torch.Tensor)):
                continue
            if value.shape != theirs.shape or not torch.equal(value, theirs):
                return f"rank {rank}'s full state differs from rank 0's at {key}"
    return None


def _rank_problem(rank: int, mine: dict, first: dict, replicas: dict) -> str | None:
    """What is wrong with ``rank``'s outcome: its error, losses other than rank 0's, or weights other
    than its dp replica's (``replicas``: the dp-index-0 outcome of each (pp, tp) position)."""
    if "error" in mine:
        return f"rank {rank} failed: {mine['error']}\n{mine.get('traceback', '')}"
    for where, part, zero in [("", mine, first)] + [(f"{k}: ", v, first.get(k)) for k, v in mine.items()
                                                   if isinstance(v, dict) and isinstance(first.get(k), dict)]:
        problem = _same_answer(rank, part, zero)
        if problem is not None:
            return where + problem
    if "replica" not in mine:
        return None
    coords = mine["coords"]
    peer = replicas.get((coords.get("pp"), coords.get("tp")))
    if peer is None or peer is mine:
        return None
    where = f"rank {rank} (dp={coords.get('dp')}, pp={coords.get('pp')}, tp={coords.get('tp')})"
    if set(mine["replica"]) != set(peer["replica"]):
        return f"{where} holds parameters {sorted(set(mine['replica']) ^ set(peer['replica']))} its dp replica does not"
    for name, tensor in mine["replica"].items():
        theirs = peer["replica"][name]
        if theirs.shape != tensor.shape:
            return f"{where}: parameter {name} has shape {tuple(tensor.shape)}, its dp replica {tuple(theirs.shape)}"
        if not torch.equal(theirs, tensor):
            diff = (tensor - theirs).abs().max().item()
            return f"{where}: parameter {name} differs from its dp replica at dp=0 (max abs difference {diff:.3g})"
    return None


def judge_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's result; ``"error"`` set (rank 0's own first) when any rank failed or disagrees."""
    result = dict(per_rank[0])
    result["rank_results"] = per_rank
    if "error" in result:
        return result
    replicas = {(r["coords"].get("pp"), r["coords"].get("tp")): r for r in per_rank
                if "replica" in r and r["coords"].get("dp") == 0}
    for rank, mine in enumerate(per_rank[1:], start=1):
        problem = _rank_problem(rank, mine, per_rank[0], replicas)
        if problem is not None:
            result["error"] = problem
            result["traceback"] = problem
            break
    return result


def assert_outputs_match(case: Case, result: dict) -> None:
    """Every rank's forward outputs equal its dp slice of one device's (fp32, relative 1e-5), every dp
    slice seen: each rank returns the model's output for its own dp slice, whatever its pp and tp."""
    assert "error" not in result, f"{case.name()} failed:\n{result.get('traceback', result['error'])}"
    local, expected, seen = case.batch // case.mesh[0], reference_outputs(case), set()
    for rank, mine in enumerate(result["rank_results"]):
        start = mine["dp_index"] * local
        seen.add(mine["dp_index"])
        for step, (got, want) in enumerate(zip(mine["outputs"], expected, strict=True)):
            torch.testing.assert_close(got, want[start:start + local], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, r=rank, s=step: f"{case.name()} rank {r} batch {s}: {m}")
    assert seen == set(range(case.mesh[0])), f"{case.name()}: dp slices seen: {sorted(seen)}"


def assert_equivalent(case: Case, result: dict, reference: dict) -> None:
    """Losses and every parameter equal to single-device training within fp32 rounding."""
    assert "error" not in result, f"{case.name()} failed:\n{result.get('traceback', result['error'])}"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                               rtol=RTOL, atol=0, msg=lambda m: f"{case.name()} losses: {m}")
    assert set(result["state"]) == set(reference["state"]), (
        f"{case.name()}: state keys differ: {set(result['state']) ^ set(reference['state'])}")
    for key, expected in reference["state"].items():
        torch.testing.assert_close(result["state"][key], expected, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=key: f"{case.name()} parameter {k}: {m}")
