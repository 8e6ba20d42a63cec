"""One rank's compiled program: its stage graphs, schedule, process groups and optimizer.

``train_step`` runs the schedule over this rank's data-parallel batch, sums tied-weight gradients
across stages, averages gradients over dp, steps the (ZeRO-sharded) optimizer and returns the
global mean loss on every rank. Calling the program (no loss) runs forward only.
Every collective it issues waits at most ``p2p_timeout_s`` (:mod:`autopar.runtime.comm_guard`).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopar.errors import PlanError
from autopar.lowering import Lowered, user_name
from autopar.mesh import MeshInfo
from autopar.passes.meta_keys import PARAM, get_meta
from autopar.passes.pipeline_split import StageGraph
from autopar.runtime.collectives import bind_collectives
from autopar.runtime.clip import clip_program_gradients
from autopar.runtime.executor import run_actions
from autopar.runtime.mixed_precision import MasterWeights
from autopar.runtime.comm_audit import CommLog
from autopar.runtime.comm_guard import CommGuard
from autopar.runtime.grad_sync import GradientSync
from autopar.runtime.p2p import P2PChannel
from autopar.runtime.schedules.action import Schedule
from autopar.runtime.schedules.forward_only import forward_only
from autopar.runtime.state import gather_full_state_dict
from autopar.runtime.tp_grad_sync import sum_partial_gradients
from autopar.runtime.zero import ShardedOptimizer, stepped_here
from autopar.runtime.checkpoint import load_checkpoint, load_full_state_dict, save_checkpoint
from autopar.runtime.rank_tensors import model_buffers
from autopar.runtime.numerics import check_finite
from autopar.runtime.index_guard import IndexGuard, graph_has_bounds
from autopar.runtime.zero3_ops import bind_zero3, full_parameters, shard_zero3_parameters
from autopar.runtime.moe_groups import (add_expert_groups, full_expert_parameters, refuse_expert_checkpoint,
                                        refuse_meta_experts)

__all__ = ["RankProgram"]

log = logging.getLogger(__name__)


def _own_parameters(stages: list[StageGraph]) -> None:
    """Give the stage graphs their own copies of the weights (ties between local stages kept)."""
    copies: dict[int, torch.nn.Parameter] = {}
    for stage in stages:
        for target in stage.param_names:
            param = stage.gm.get_parameter(target)
            if id(param) not in copies:
                copies[id(param)] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            owner, _, leaf = target.rpartition(".")
            setattr(stage.gm.get_submodule(owner) if owner else stage.gm, leaf, copies[id(param)])


class RankProgram:
    """This rank's share of the parallel program."""

    def __init__(self, *, lowered: Lowered, info: MeshInfo, schedule: Schedule, optimizer_factory,
                 state_keys: tuple[str, ...], p2p_timeout_s: float, masters: dict | None = None,
                 max_grad_norm: float | None = None, materialize=None):
        self.plan = lowered.plan
        self.info = info
        self.schedule = schedule
        self.captured = lowered.captured
        self.state_keys = state_keys
        pp_rank = info.coords["pp"]
        mine = [s for s in lowered.stages if schedule.stage_to_rank[s.stage] == pp_rank]
        _own_parameters(mine)
        if self.plan.zero_stage == 3:  # ZeRO-3 graphs gather their parameters: keep only this rank's shards
            shard_zero3_parameters([s.gm for s in mine], dp_rank=info.coords["dp"], dp_size=info.shape.dp)
        refuse_meta_experts(self.plan, meta=materialize is not None)  # runtime/moe_groups.py
        if materialize is not None:  # a meta-built model: this rank's pieces only (runtime/materialize.py)
            materialize([s.gm for s in mine])
        self.stages = {s.stage: s for s in mine}
        # token ids and positions range-checked each step before the stages read them (runtime/index_guard.py)
        self.index_guard = IndexGuard(self.stages, active=graph_has_bounds(lowered.captured.gm))
        self.phase = "schedule"  # what the step is doing, for errors (the action itself while the schedule runs)
        self.comm_guard = CommGuard(rank=info.rank, timeout_s=p2p_timeout_s, place=self._place)
        self.comm_log = CommLog(guard=self.comm_guard)  # this step's dp collectives (runtime/comm_audit.py)
        self.stage_ranks = {s: info.peer("pp", r) for s, r in enumerate(schedule.stage_to_rank)}
        self.channel = P2PChannel(rank=info.rank, stage_to_rank=self.stage_ranks, group=info.groups["pp"],
                                  timeout_s=p2p_timeout_s)
        if self.plan.expert_parallel > 1:  # MoE experts over ep ranks of dp (runtime/moe_groups.py)
            add_expert_groups(info, ep=self.plan.expert_parallel)
        for stage in mine:
            bind_collectives(stage.gm, info.groups, self.comm_guard)
            for module in stage.gm.modules():
                if hasattr(module, "bind") and hasattr(module, "edge"):
                    module.bind(self.channel)
        zero3 = [bind_zero3(s.gm, group=info.groups["dp"], size=info.shape.dp, comm_log=self.comm_log) for s in mine]
        self.named_params = self._named_parameters()
        compute_ids = {n: id(p) for n, p in self.named_params}
        stepped = stepped_here(self.named_params, zero_stage=self.plan.zero_stage, dp_size=info.shape.dp,
                               dp_rank=info.coords["dp"])  # ZeRO-1/2: masters only where a parameter is stepped
        self.mixed = MasterWeights(self.named_params, masters, stepped=stepped) if masters is not None else None
        if self.mixed is not None:  # bf16 graphs: the runtime steps fp32 masters (runtime/mixed_precision.py)
            self.named_params = self.mixed.named
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        partial = {user_name(t) for t in lowered.tp_partial_grads}  # sequence parallelism: summed over tp
        self.tp_partial_params = [p for n, p in self.named_params if n in partial]
        self.optimizer = ShardedOptimizer(self.named_params, optimizer_factory, zero_stage=self.plan.zero_stage,
                                          dp_group=info.groups["dp"], dp_ranks=info.axis_ranks["dp"],
                                          dp_rank=info.coords["dp"], comm_log=self.comm_log,
                                          publish=self.mixed.publish if self.mixed is not None else None,
                                          synced=self.mixed.compute if self.mixed is not None else None,
                                          local=frozenset(self.plan.expert_params))  # experts: stepped where held
        uses: dict[int, int] = {}
        for stage in mine:
            for p in {id(stage.gm.get_parameter(t)) for t in stage.param_names}:
                uses[p] = uses.get(p, 0) + 1
        self.grad_sync = GradientSync(self.named_params, shared=self._shared_params(), plan=self.plan, info=info,
                                      owners=self.optimizer.owner_of(), comm_log=self.comm_log,
                                      uses={n: uses[compute_ids[n]] for n, _ in self.named_params},
                                      current_action=lambda: self.channel.action,
                                      zero3_runtimes=tuple(r for r in zero3 if r is not None))
        self.last_stage_rank = self.stage_ranks[len(self.stage_ranks) - 1]
        # ranks whose stages compute the loss (two for Chimera: one per replica)
        self.loss_ranks = sorted({self.stage_ranks[s.stage] for s in lowered.stages if s.is_last})
        self.inference_schedule = forward_only(schedule)  # replica 0's stages, depth first, F only
        self.output_rank = self.stage_ranks[schedule.parts - 1]
        self.aliases = {user_name(n.target): tuple(user_name(a) for a in get_meta(n, PARAM).aliases)
                        for s in lowered.stages for n in s.gm.graph.nodes
                        if n.op == "get_attr" and get_meta(n, PARAM) is not None}
        self.events: list = []
        self.step_count = 0  # completed optimizer steps (saved and restored by checkpoints)

    # -- what a person reads -------------------------------------------------------------
    @property
    def graphs(self) -> dict[int, torch.fx.GraphModule]:
        """This rank's rewritten stage graphs, by stage index."""
        return {s: st.gm for s, st in sorted(self.stages.items())}

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        seen, named = set(), []
        for stage in self.stages.values():
            for target in stage.param_names:
                p = stage.gm.get_parameter(target)
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((user_name(target), p))
        return named

    # -- running ---------------------------------------------------------------------------
    def _microbatches(self, tensors: tuple) -> list[dict]:
        m = self.plan.pipeline.num_microbatches
        local = self.plan.global_batch_size // self.plan.mesh.dp
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != local:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise PlanError(f"expected this rank's data-parallel batch of {local} rows, got {got}",
                                where=f"rank {self.info.rank} (dp index {self.info.coords['dp']})",
                                fix="pass global_batch[dp_index * local:(dp_index + 1) * local]; "
                                    "program.shard_batch(global_batch) does it")
        names = self.captured.input_names
        chunks = [t.chunk(m, dim=0) for t in tensors]
        return [{name: c[i] for name, c in zip(names, chunks)} for i in range(m)]

    def _batch(self, inputs: tuple, target, where: str) -> tuple:
        """The graph's inputs in order, from tensors or from one dict batch (its keyword inputs)."""
        keywords = self.captured.keywords
        if keywords is not None:
            if len(inputs) != 1 or not isinstance(inputs[0], dict):
                raise PlanError("this program was compiled on a dict batch", where=where,
                                fix=f"pass one dict with the keys {list(keywords)}")
            missing = [k for k in keywords if k not in inputs[0]]
            if missing:
                raise PlanError(f"the batch lacks {missing}", where=where,
                                fix=f"pass the keys the program was compiled with: {list(keywords)}")
            inputs = tuple(inputs[0][k] for k in keywords)
        if self.captured.has_target:
            if target is None:
                raise PlanError("this program was compiled with a loss_fn: the step needs its target", where=where,
                                fix="pass target= (this rank's dp slice of the targets)")
            inputs = tuple(inputs) + (target,)
        return tuple(inputs)

    def shard_batch(self, tensor):
        """This rank's dp slice of a global batch (a tensor, or each tensor of a dict batch)."""
        if isinstance(tensor, dict):
            return {k: self.shard_batch(v) for k, v in tensor.items()}
        local = tensor.shape[0] // self.plan.mesh.dp
        return tensor[self.info.coords["dp"] * local: (self.info.coords["dp"] + 1) * local]

    def _place(self) -> str:
        """Where this rank is, for a collective's error: its stages and the action or phase running."""
        stages = ", ".join(str(s) for s in sorted(self.stages))
        doing = f"action {self.channel.action}" if self.phase == "schedule" else self.phase
        return f"stage {stages}, {doing}"

    def _shared_params(self) -> list:
        """(parameter, global ranks holding a copy) of the weights tied across pipeline ranks."""
        shared = []
        for name, stages in self.plan.shared_params.items():
            ranks = sorted({self.stage_ranks[s] for s in stages})
            if self.info.rank in ranks and len(ranks) > 1:
                shared.append((dict(self.named_params)[name], ranks))
        return shared

    def _sync_gradients(self) -> None:
        """Wait for the dp reductions started during backward; tied weights across stages (grad_sync.py)."""
        self.grad_sync.finish()

    def train_step(self, *inputs, target: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step on this rank's dp batch; returns the global mean loss (every rank).

        ``inputs``: the tensors, or the one dict batch the program was compiled on; ``target`` when
        it was compiled with a ``loss_fn`` (a dict batch with ``labels`` and no loss_fn needs none).
        """
        if not self.captured.has_loss:
            raise PlanError("this program was compiled without a loss", where="train_step",
                            fix="pass loss_fn= (and example_target=) to autopar.compile, or a dict batch with labels")
        batches = self._microbatches(self._batch(inputs, target, "train_step"))
        index_problem = self.index_guard.inspect(batches)  # reported with the non-finite check, on every rank
        self.optimizer.zero_grad()
        self.events = []
        self.comm_log.reset()
        self.grad_sync.begin(len(batches))
        self.phase = "schedule"
        results = run_actions(self.schedule.actions[self.info.coords["pp"]], stages=self.stages,
                              microbatches=batches, channel=self.channel, train=True, events=self.events)
        if self.mixed is not None:
            self.mixed.collect()
        self.phase = "gradient sync after the schedule"
        self._sync_gradients()
        sum_partial_gradients(self.tp_partial_params, group=self.info.groups["tp"], guard=self.comm_guard)
        self.phase = "non-finite check"
        # runtime/numerics.py: a NaN/inf, or a bad index any rank found, stops the step on every rank
        check_finite(self, results, index_problem=index_problem)
        if self.max_grad_norm is not None:  # runtime/clip.py: the global norm over every shard and axis
            self.phase = "gradient clipping"
            self.last_grad_norm = clip_program_gradients(self, max_norm=self.max_grad_norm)
        self.phase = "optimizer step"
        self.optimizer.step()  # then publishes the masters into the bf16 copies (mixed precision)
        self.step_count += 1
        self.phase = "loss reduction"
        return self._global_loss(results)

    def _global_loss(self, results: dict) -> torch.Tensor:
        if results:
            loss = torch.stack([results[i][0] if isinstance(results[i], (tuple, list)) else results[i]
                                for i in sorted(results)]).float().mean()  # fp32 on every rank (bf16 graphs)
        else:
            loss = torch.zeros(())
        if len(self.loss_ranks) > 1:  # Chimera: each replica's last stage holds its microbatches' losses
            total = loss * len(results) if results else torch.zeros(())
            self.comm_guard.run("all_reduce", dist.all_reduce, total, group=self.info.groups["pp"],
                                purpose="the loss of both Chimera replicas")
            loss = total / self.plan.pipeline.num_microbatches
        if self.plan.mesh.dp > 1:
            self.comm_guard.run("all_reduce", dist.all_reduce, loss, group=self.info.groups["dp"],
                                purpose="the step's loss (mean over dp)")
            loss /= self.plan.mesh.dp
        if self.plan.mesh.pp > 1 and len(self.loss_ranks) == 1:
            self.comm_guard.run("broadcast", dist.broadcast, loss, src=self.last_stage_rank,
                                group=self.info.groups["pp"], purpose="the step's loss (from the last stage)")
        return loss

    @torch.no_grad()
    def __call__(self, *inputs):
        """Forward only (no activations kept): the model's output for this rank's batch, on every rank."""
        batches = self._microbatches(self._batch(inputs, None, "program(...)") if self.captured.keywords
                                     else tuple(inputs))
        self.phase = "index range check"
        self.index_guard.agree(self.index_guard.inspect(batches), guard=self.comm_guard, rank=self.info.rank,
                               step="a forward-only call")
        self.phase = "schedule"
        actions = self.inference_schedule.actions[self.info.coords["pp"]]
        results = run_actions(actions, stages=self.stages, microbatches=batches, channel=self.channel,
                              train=False)
        payload = [None]
        if results:
            flat = [pytree.tree_flatten(results[i])[0] for i in sorted(results)]
            payload = [[torch.cat(parts, dim=0) for parts in zip(*flat)]]
        if self.plan.mesh.pp > 1:
            self.phase = "output broadcast"
            self.comm_guard.call("broadcast_object_list", dist.broadcast_object_list, payload, src=self.output_rank,
                                 group=self.info.groups["pp"], purpose="the forward's outputs")
        outputs = pytree.tree_unflatten(payload[0], self.captured.out_spec)
        return outputs

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as the original (single-device) model names them, on every rank."""
        named = full_parameters(self.parameter_values(), [s.gm for s in self.stages.values()],
                                group=self.info.groups["dp"], size=self.plan.mesh.dp)
        if self.plan.expert_parallel > 1:  # every ep rank's experts (runtime/moe_groups.py)
            named = full_expert_parameters(list(named), experts=self.plan.expert_params, group=self.info.groups["ep"],
                                           guard=self.comm_guard)
        return gather_full_state_dict(list(named) + model_buffers(self), plan=self.plan, info=self.info,
                                      aliases=self.aliases, keys=self.state_keys)

    def parameter_values(self) -> list[tuple[str, torch.Tensor]]:
        """(name, value) of every parameter this rank holds, fp32 masters under mixed precision, where
        ZeRO-1/2 keep a master only on the parameter's owner: the others are fetched (collective over dp)."""
        if self.mixed is None:
            return self.named_params
        return self.optimizer.owners_values(self.named_params)

    # -- checkpoints (runtime/checkpoint.py); collective: every rank calls them ----------------
    def save_checkpoint(self, root: str) -> str:
        """Save weights, buffers, optimizer state and step under ``root`` (atomically); the step folder."""
        refuse_expert_checkpoint(self.plan, "save_checkpoint")
        return save_checkpoint(self, root)

    def load_checkpoint(self, path: str) -> int:
        """Load ``root``'s latest checkpoint (or one step folder), saved on any mesh; returns its step."""
        refuse_expert_checkpoint(self.plan, "load_checkpoint")
        step = load_checkpoint(self, path)
        if self.mixed is not None:  # round the masters into the bf16 copies; ZeRO-1/2 owners broadcast them
            self.optimizer.publish_parameters()
        return step

    def load_full_state_dict(self, state_dict: dict) -> None:
        """Set the weights from a single-device ``state_dict`` (``model.state_dict()``)."""
        refuse_expert_checkpoint(self.plan, "load_full_state_dict")
        load_full_state_dict(self, state_dict)
        if self.mixed is not None:
            self.optimizer.publish_parameters()
