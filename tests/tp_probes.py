"""Runner kinds for the tensor-parallel tests, run inside the harness's spawned groups.

Use as ``Case(kind="tp_probes:saved_bytes_run", ...)`` or ``kind="tp_probes:dropout_masks_run"``;
only rank 0's result comes back, so each runner gathers what it needs from the other ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from equivalence import Case, batches, build


def _compile(case: Case, mesh):
    import autopar
    from autopar.models import lm_loss
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], p2p_timeout_s=120, **dict(case.options))
    return program, data


def _stage_inputs(program, stage, idx, tgt) -> list:
    """One microbatch of this rank's data-parallel slice, as the stage graph reads it."""
    mb = program.plan.microbatch_size
    batch = {"idx": program.shard_batch(idx)[:mb], "target": program.shard_batch(tgt)[:mb]}
    return [batch[name] for name in stage.input_names]


class _SavedBytes(fx.Interpreter):
    """Runs a graph with autograd on and attributes every tensor saved for backward to its block.

    Tensors on a parameter's or buffer's storage (a weight, the transposed view a linear saves,
    a slice of a rotary table) are not activations and are left out; a storage saved twice (or
    as two views) counts once.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.weights = {p.untyped_storage().data_ptr() for p in list(gm.parameters()) + list(gm.buffers())}
        self.per_unit: dict[str, dict[int, int]] = {}

    def run_node(self, n):
        from autopar.ir.meta_keys import MODULE, get_meta
        info = get_meta(n, MODULE)
        seen = self.per_unit.setdefault(info.unit if info else "", {})

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if t.is_floating_point() and storage.data_ptr() not in self.weights:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return super().run_node(n)


def saved_bytes_per_unit(gm: fx.GraphModule, inputs: list) -> dict[str, int]:
    """{pipeline unit: bytes of activations saved for backward} for one forward of ``gm``."""
    probe = _SavedBytes(gm)
    out = probe.run(*inputs)
    del out
    return {unit: sum(seen.values()) for unit, seen in probe.per_unit.items()}


def saved_bytes_run(case: Case, mesh) -> dict:
    """Saved activation bytes per block of one forward of the (single) stage, from every tp rank."""
    program, data = _compile(case, mesh)
    (stage,) = program.stages.values()
    per_unit = saved_bytes_per_unit(stage.gm, _stage_inputs(program, stage, *data[0]))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, per_unit)
    return {"saved_bytes": per_rank, "plan": program.plan.model_dump_json()}


class _Recorder(fx.Interpreter):
    """Runs a stage graph and keeps the zero pattern of every dropout output (its mask)."""

    def __init__(self, gm, names):
        super().__init__(gm)
        self.names, self.masks = names, {}

    def run_node(self, n):
        value = super().run_node(n)
        if n.name in self.names:
            self.masks[n.name] = value == 0
        return value


def dropout_masks_run(case: Case, mesh) -> dict:
    """Masks of the replicated and the sharded dropouts of one forward, from every tp rank."""
    from autopar.ops.tp_rng import ShardedRandom
    from autopar.passes.tp.tp_random import is_random
    program, data = _compile(case, mesh)
    (stage,) = program.stages.values()
    gm = stage.gm
    sharded = [n.name for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), ShardedRandom)]
    replicated = [n.name for n in gm.graph.nodes if is_random(n)]
    recorder = _Recorder(gm, set(sharded + replicated))
    torch.manual_seed(7)  # the same default stream on every rank, as a user seeds every process alike
    default_before = torch.get_rng_state()
    recorder.run(*_stage_inputs(program, stage, *data[0]))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"masks": recorder.masks, "default_state": default_before})
    return {"sharded": sharded, "replicated": replicated, "per_rank": per_rank}
