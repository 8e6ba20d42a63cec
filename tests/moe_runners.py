"""Runner kinds for the MoE cases of tests/equivalence.py (``kind="moe_runners:train"``).

Models: the plain-torch ``switch`` and ``deepseek`` (autopar.models.moe, loss ``moe_loss``: cross-entropy
plus the router's load-balancing loss) and ``hf_mixtral`` / ``hf_qwen3_moe`` (transformers, trained on their
own loss from ``labels``: cross-entropy plus ``router_aux_loss_coef`` times their load-balancing loss).

The replica record is keyed for expert parallelism: dp ranks that hold the same experts (same ``dp % ep``)
must agree bitwise, so each rank reports its expert-data-parallel index as ``dp`` and ``(tp, dp % ep)`` as
its position; :func:`equivalence.judge_ranks` then compares every rank with the first one holding its experts.
"""
from __future__ import annotations

import logging

import torch

from equivalence import Case, make_optimizer, replica_record, scrambled

HF_PREFIX = "hf_"


def build(case: Case, device=None):
    torch.manual_seed(1234)
    if case.model.startswith(HF_PREFIX):
        from autopar.models.moe import build_hf_moe
        with torch.device(device or "cpu"):
            return build_hf_moe(case.model[len(HF_PREFIX):], **dict(case.overrides))
    from autopar.models.moe import build_moe
    return build_moe(case.model, **dict(case.overrides))


def batches(case: Case, vocab: int = 64) -> list:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(case.steps):
        idx = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
        tgt = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
        out.append({"input_ids": idx, "labels": tgt} if case.model.startswith(HF_PREFIX) else (idx, tgt))
    return out


def _loss(model, batch):
    if isinstance(batch, dict):
        return model(**batch).loss
    from autopar.models.moe import moe_loss
    return moe_loss(model(batch[0]), batch[1])


def reference(case: Case) -> dict:
    """One device: losses per step, the final state_dict, and the gradient norms torch's clipping saw
    (with ``max_grad_norm``)."""
    model = build(case)
    opt = make_optimizer(case)(list(model.parameters()))
    losses, norms = [], []
    max_norm = dict(case.options).get("max_grad_norm")
    for batch in batches(case):
        opt.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        if max_norm is not None:  # torch's clipping is the reference for autopar's
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad_norms": norms}


def _dropped(program) -> tuple[int, int]:
    from autopar.ops.moe_ops import dropped_rows
    return dropped_rows(program.graphs.values())


def _expert_record(program) -> dict:
    """Elements of expert weights and of their optimizer state on this rank, and the exchange nodes per graph."""
    from autopar.ops.moe_ops import MoeCombine, MoeDispatch
    experts = set(program.plan.expert_params)
    named = dict(program.named_params)
    weights = sum(named[n].numel() for n in experts if n in named)
    opt = program.optimizer.optimizer
    state = sum(t.numel() for n in experts if n in named for t in opt.state.get(named[n], {}).values()
                if isinstance(t, torch.Tensor) and t.dim() > 0) if opt is not None else 0
    exchanges = {}
    for stage, gm in program.graphs.items():  # the all-to-alls and the experts' own tp f/g, in graph order
        kinds = [type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"
                 and (isinstance(gm.get_submodule(n.target), (MoeDispatch, MoeCombine))
                      or str(n.target).startswith("tp_expert_"))]
        exchanges[stage] = kinds
    return {"expert_elements": weights, "expert_state_elements": state, "exchanges": exchanges,
            "expert_shapes": {n: list(named[n].shape) for n in experts if n in named},
            "graph_code": {s: gm.code for s, gm in program.graphs.items()}}


class _CountExchanges:
    """Counts the row all-to-alls the running program issues (forward, and the conjugates in backward)."""

    def __init__(self):
        import autopar.ops.moe_ops as ops
        self.ops, self.original = ops, ops.all_to_all_rows
        self.forward = self.backward = 0

    def __enter__(self):
        def counted(rows, send, recv, group, guard, purpose):
            if purpose.startswith("the backward of"):
                self.backward += 1
            else:
                self.forward += 1
            return self.original(rows, send, recv, group, guard, purpose)
        self.ops.all_to_all_rows = counted
        return self

    def __exit__(self, *exc):
        self.ops.all_to_all_rows = self.original


# a case with ("weights", True) builds its model on meta and loads it from this folder under CKPT_ENV, which
# the test writes before spawning (write_weights: the CPU build's save_pretrained, in the model's own names)
WEIGHTS = "weights"
SAVE = "save_pretrained"  # (at tp > 1 always) save_pretrained after training, read back by transformers on rank 0


def weights_folder(case: Case) -> str:
    import os
    return os.path.join(os.environ[CKPT_ENV], f"weights-{case.model}" + "".join(f"-{k}={v}" for k, v in case.overrides))


def write_weights(case: Case) -> None:
    import os
    if not os.path.isdir(weights_folder(case)):
        build(case).save_pretrained(weights_folder(case), save_original_format=False)


def _meta_model(case: Case):
    """The case's model built on meta and compile's filler reading each rank's pieces from the folder."""
    import autopar.hf
    model = build(case, device="meta")
    return model, autopar.hf.pretrained_weights(weights_folder(case), model)


def _compile(case: Case, mesh, model=None, more: dict | None = None):
    """(program, a step function of one batch, the batches) of an MoE case on this rank."""
    import autopar
    from autopar.models.moe import moe_loss
    weights = None
    if model is None and dict(case.extra).get(WEIGHTS):
        model, weights = _meta_model(case)
    model = model if model is not None else build(case)
    data = batches(case)
    first = data[0]
    options = {**dict(case.options), **(more or {})}
    if isinstance(first, dict):
        program = autopar.compile(model, mesh, example_inputs=first, optimizer=make_optimizer(case),
                                  p2p_timeout_s=120, weights=weights, **options)
        step = lambda b: program.train_step(program.shard_batch(b))  # noqa: E731
    else:
        program = autopar.compile(model, mesh, example_inputs=(first[0],), loss_fn=moe_loss,
                                  example_target=first[1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                                  **options)
        step = lambda b: program.train_step(program.shard_batch(b[0]), target=program.shard_batch(b[1]))  # noqa: E731
    return program, step, data


class _Logged(logging.Handler):
    """The messages one logger gives at INFO while the block runs (what the block template did)."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def _norm(program) -> float | None:
    """The last step's global gradient norm before clipping (None without max_grad_norm)."""
    return None if program.last_grad_norm is None else program.last_grad_norm.item()


def _replica(program) -> dict:
    """:func:`equivalence.replica_record` with the ep rank in the position: ranks of one ep group hold other
    experts, so a replica is the rank with the same (pp, tp, dp mod ep) at edp index 0."""
    record = replica_record(program)
    ep = program.plan.expert_parallel
    coords = dict(record["coords"])
    record["coords"] = {"dp": coords["dp"] // ep, "pp": coords["pp"], "tp": (coords["tp"], coords["dp"] % ep)}
    return record


def train(case: Case, mesh, more: dict | None = None) -> dict:
    """This rank's run of an MoE case under autopar; the last step counts its all-to-alls."""
    with _Logged("autopar.passes.frontend.block_template") as template:
        program, step, data = _compile(case, mesh, more=more)
    losses, norms = [], []
    for b in data[:-1]:
        losses.append(step(b).item())
        norms.append(_norm(program))
    with _CountExchanges() as counted:
        losses.append(step(data[-1]).item())
    norms.append(_norm(program))
    record = _replica(program)
    state = program.full_state_dict()
    pretrained = _pretrained_round_trip(case, program, state) if pretrained_round_trip(case) else None
    reloaded = _reload(case, program) if dict(case.extra).get(WEIGHTS) and dict(case.extra).get(SAVE) else None
    from autopar.runtime.diagnostics.memory_probe import held_state_bytes
    return {"losses": losses, "state": state, "plan": program.plan.model_dump_json(),
            "states": held_state_bytes(program),
            "dropped": _dropped(program), **record, **_expert_record(program), "grad_norms": norms,
            "all_to_all": (counted.forward, counted.backward), "pretrained": pretrained,
            "block_template": template.messages, "reloaded": reloaded, "rank": program.info.rank,
            "groups": {axis: program.info.axis_ranks.get(axis) for axis in ("ep", "edp")}}


def auto_train(case: Case, mesh) -> dict:
    """:func:`train` with ``plan="auto"`` on a cluster whose memory holds split experts but not replicated ones
    (every rank works the same figure out: the planner's own estimates of the two, the device memory between)."""
    from autopar.models.moe import moe_loss
    from autopar.planner import Candidate, CostModel, get_cluster, profile_model
    idx, tgt = batches(case)[0]
    profile = profile_model(build(case), example_inputs=(idx,), loss_fn=moe_loss, example_target=tgt, tp_degrees=(1,))
    base = get_cluster("cpu-2core", world=case.world_size)
    model = CostModel(profile, base, optimizer="momentum")  # make_optimizer: SGD with momentum
    need = [model.estimate(Candidate(case.mesh[0], 1, 1, 1, expert_parallel=ep)).memory for ep in (1, 2)]
    tight = base.model_copy(update={"device": base.device.model_copy(update={"memory_gb": sum(need) / 2 / 1e9})})
    return {**train(case, mesh, more={"plan": "auto", "cluster": tight}), "needs": need}


def pretrained_round_trip(case: Case) -> bool:
    """Does ``train`` save this case with ``save_pretrained``? Split experts cut further: over tp, or into
    ZeRO-3 blocks over edp (dp > ep), or a case that asks (``SAVE``)."""
    options, (dp, _, tp) = dict(case.options), case.mesh
    ep = options.get("expert_parallel", 1)
    return case.model.startswith(HF_PREFIX) and ep > 1 and (tp > 1 or bool(dict(case.extra).get(SAVE))
                                                            or (options.get("zero_stage") == 3 and dp > ep))


def _pretrained_round_trip(case: Case, program, state: dict):
    """``save_pretrained`` of split experts, read back by transformers on rank 0: the keys whose weights differ."""
    import os
    import autopar.hf
    import torch.distributed as dist
    folder = autopar.hf.save_pretrained(program, os.path.join(os.environ[CKPT_ENV], f"hf-{case.name()}"))
    if dist.get_rank() != 0:
        return None
    back = type(build(case)).from_pretrained(folder).state_dict()
    return sorted(k for k in state if k not in back or not torch.equal(back[k], state[k]))


def _reload(case: Case, program) -> list[str]:
    """``load_pretrained`` of the case's weight folder into the trained program (each rank its experts' rows):
    the keys whose weights then differ from the CPU build's."""
    import autopar.hf
    autopar.hf.load_pretrained(program, weights_folder(case))
    state, want = program.full_state_dict(), build(case).state_dict()
    return sorted(k for k in want if k not in state or not torch.equal(state[k], want[k]))


# -- checkpoints of split experts: saved on one (dp, ep, tp), resumed on another ---------------------
CKPT_ENV = "AUTOPAR_TEST_MOE_CKPT"  # the folder the test names before spawning


def _ckpt_root(case: Case) -> str:
    import os
    return os.path.join(os.environ[CKPT_ENV], dict(case.extra)["name"])


def _scrambled(case: Case):
    """The case's model with other weights: what a load must overwrite."""
    return scrambled(build(case))


def save(case: Case, mesh) -> dict:
    """Train the first ``save_after`` steps and save a checkpoint; the losses of those steps."""
    program, step, data = _compile(case, mesh)
    losses = [step(b).item() for b in data[:dict(case.extra)["save_after"]]]
    folder = program.save_checkpoint(_ckpt_root(case))
    return {"losses": losses, "folder": folder, "step": program.step_count}


def resume(case: Case, mesh) -> dict:
    """Compile with other weights, load the checkpoint saved on another mesh, train the remaining steps;
    then ``load_full_state_dict`` of another model's weights, read back through ``full_state_dict``."""
    program, step, data = _compile(case, mesh, model=_scrambled(case))
    start = program.load_checkpoint(_ckpt_root(case))
    losses = [step(b).item() for b in data[start:]]
    state = program.full_state_dict()
    record = _replica(program)  # before the load below replaces the trained weights
    other = {k: v.detach().clone() for k, v in _scrambled(case).state_dict().items()}
    program.load_full_state_dict(other)
    back = program.full_state_dict()
    return {"losses": losses, "state": state, "step": start,
            "full_state_round_trip": all(torch.equal(back[k], other[k]) for k in back)
            and set(back) == set(other), **record}
