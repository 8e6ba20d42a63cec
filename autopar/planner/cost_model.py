"""The cost model: step time and memory per rank of one candidate plan, from the model profile.

Time, per chunk and microbatch of ``b`` samples, on a device of matmul rate ``R`` (peak x
efficiency x the measured factor at ``b`` samples, :meth:`Device.rate_factor`: small microbatches
run matmuls below the rate of large ones), memory bandwidth ``BW`` and per-op overhead ``o``:

- forward ``F = flops·b/R + gemms·g + bytes·b/BW + ops·o`` (+ the forward collectives), ``g`` the
  device's ``gemm_overhead_s`` per matrix product (small products reach less of ``R``);
- backward twice the forward compute, split evenly into the input-gradient part ``B`` (with the
  backward collectives) and the weight-gradient part ``W``; where a schedule splits them (every
  stage but the first, which runs its backward whole), ``W`` also carries the device's
  ``split_backward_overhead`` share of the backward; full recomputation adds ``F`` (and its
  collectives) to ``B``, selective recomputation its non-matmul part;
- every collective by the alpha-beta model of the link it runs on (tp: inside a node);
- mixture of experts with ``expert_parallel`` > 1: per MoE layer and microbatch, three all-to-alls
  forward (the per-expert row counts, the dispatch, the combine) and their two conjugates backward
  (:func:`moe_comm`), over the ep group's link;
- the pipeline from :func:`autopar.runtime.schedules.simulator.simulate` on the per-stage
  ``F``, ``B``, ``W`` and the p2p time of the largest boundary (or, for ranking many
  candidates quickly, a proven lower bound of that simulation:
  :mod:`autopar.planner.pipeline_bound`; the search simulates best-first by it);
- data parallelism: the gradient all-reduce (ZeRO-0), reduce + broadcast (ZeRO-1/2), or a
  gather in forward and backward plus a reduce-scatter per microbatch (ZeRO-3), of which the
  cluster's ``dp_overlap`` share hides behind backward (not for ZeRO-3); split experts' gradients
  are all-reduced over the ``dp / ep`` ranks holding the same experts instead;
- ranks sharing cores (CPU processes, ``k`` ranks per core): the pipeline simulated with processor
  sharing (:mod:`autopar.runtime.schedules.shared_cores`: a rank waiting lends its core), each
  action costing the cluster's ``shared_core_switch_s`` more;
- the optimizer step: every element the rank steps read and written once (memory bound; all ranks
  of a node at once where they share cores);
- the cluster's ``step_overhead_s`` once per step (data loading, launches, logging).

Memory, per rank: parameters, gradients and optimizer state from :func:`autopar.memory.states.state_figures`
(the memory calculator's formulas, by ZeRO stage and precision; split experts at ``1/ep`` of their
elements, their ZeRO-1/2 state partitioned over ``dp / ep``, as ``state_figures(local=..., ep=...)`` counts
them) plus activations: the bytes a
microbatch saves on each of the rank's stages times the microbatches the schedule keeps in flight
there (:func:`autopar.memory.peak_bytes` on the schedule's action list), plus the largest
recompute transient.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from functools import cached_property

from autopar.errors import PlanError
from autopar.memory.activations import peak_bytes
from autopar.memory.states import OPTIMIZER_STATE, ParamEntry, owned_experts, state_figures
from autopar.parallel_dims import ParallelDims
from autopar.planner.cluster import Cluster, Device
from autopar.planner.pipeline_bound import pipeline_lower_bound
from autopar.planner.chunk_time import chunk_times, comm_time, cp_comm, moe_comm
from autopar.planner.profile import ModelProfile
from autopar.planner.schedule_shapes import full_schedule, schedule_of, stages_of
from autopar.runtime.schedules.registry import family, splits_backward
from autopar.runtime.schedules.shared_cores import simulate_shared_cores
from autopar.runtime.schedules.simulator import StageCosts, simulate

__all__ = ["Candidate", "Estimate", "CostModel", "estimate"]

_OPT_BYTES = {"sgd": 12, "momentum": 20, "adam": 28, "adamw": 28}  # bytes touched per element per step


@dataclass(frozen=True)
class Candidate:
    """One point of the search space; ``cuts``: the chunk index each stage after the first begins at."""

    dp: int
    pp: int
    tp: int
    num_microbatches: int
    schedule: str = "1f1b"
    num_virtual: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    cuts: tuple[int, ...] = ()
    expert_parallel: int = 1  # MoE experts split over this many ranks of dp (docs/moe.md)
    cp: int = 1  # context parallelism: every sequence cut over cp ranks (docs/context_parallel.md)
    cp_strategy: str = "ring"  # cp's attention: "ring" or "all_to_all" (the Plan's cp_strategy)

    @property
    def num_stages(self) -> int:
        return self.pp * self.num_virtual

    @cached_property
    def dims(self) -> ParallelDims:
        """The candidate's degrees (``expert_parallel`` included), validated: autopar/parallel_dims.py."""
        return ParallelDims(dp=self.dp, cp=self.cp, pp=self.pp, tp=self.tp, ep=self.expert_parallel)

    @property
    def dcp(self) -> int:
        """The ranks a weight's gradient is summed over (and ZeRO shards over): dp x cp."""
        return self.dp * self.cp

    def label(self) -> str:
        sched = self.schedule + (f"(v={self.num_virtual})" if self.num_virtual > 1 else "")
        ep = f" ep={self.expert_parallel}" if self.expert_parallel > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        attention = f" {self.cp_strategy} attention" if self.cp > 1 else ""
        return (f"dp={self.dp}{cp} pp={self.pp} tp={self.tp}{ep} m={self.num_microbatches} {sched} "
                f"ZeRO-{self.zero_stage} rc={self.recompute}{attention}")


@dataclass
class Estimate:
    """What the cost model says of a candidate."""

    candidate: Candidate
    step_time: float
    parts: dict = field(default_factory=dict)  # seconds: compute, tp/ep/cp comm, bubble, p2p, dp_comm, optimizer
    memory: float = 0.0  # peak bytes of the fullest rank
    memory_parts: dict = field(default_factory=dict)  # that rank's params, grads, optimizer, activations
    capacity: float = 0.0  # usable bytes on that rank
    simulated: bool = False
    reasons: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory <= self.capacity


def _stage_ranges(cuts: tuple[int, ...], num_chunks: int) -> list[tuple[int, int]]:
    bounds = (0,) + tuple(cuts) + (num_chunks,)
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _max_share(numels: tuple[int, ...], dp: int) -> list[int]:
    """Indices of the parameters the most-loaded dp rank owns (the runtime's greedy partition)."""
    heap = [(0, i, []) for i in range(dp)]
    for idx in sorted(range(len(numels)), key=lambda i: -numels[i]):
        load, k, owned = heapq.heappop(heap)
        owned.append(idx)
        heapq.heappush(heap, (load + numels[idx], k, owned))
    return max(heap, key=lambda e: (e[0], -e[1]))[2]


def _states(params: tuple[ParamEntry, ...], buffers: int, zero: int, dims: ParallelDims, precision: str,
            optimizer: str, local: frozenset[str] = frozenset()):
    """(model-state bytes, elements stepped) of the fullest dp rank (the memory calculator's formulas;
    ``local``: MoE experts split over ep, under ZeRO-1/2 partitioned over edp)."""
    owned, dp, first = None, dims.dcp, {"dp": 0}
    trainable = [p for p in params if p.trainable]
    stepped = sum(p.numel for p in trainable)
    if zero in (1, 2) and dp > 1:
        shared = [p for p in trainable if p.name not in local]
        share = _max_share(tuple(p.numel for p in shared), dp)
        owned = [[shared[i].name for i in share]] + [[] for _ in range(dp - 1)]
        experts = owned_experts(list(params), dims=dims, coords=first, local=local)
        stepped = sum(shared[i].numel for i in share) + sum(p.numel for p in trainable if p.name in experts)
    elif zero == 3 and dp > 1:
        stepped = sum(-(-p.numel // dp) for p in trainable)
    figures = state_figures(list(params), buffers, zero_stage=zero, dims=dims, coords=first, precision=precision,
                            optimizer=optimizer, owned=owned, local=local)
    return figures, stepped


def _dp_link(cluster: Cluster, c: Candidate):
    return cluster.intra if c.dcp * c.pp * c.tp <= cluster.devices_per_node else cluster.inter


def _cp_link(cluster: Cluster, c: Candidate):
    """The link of a cp group: cp adjacent indices right inside dp, ``cp·pp·tp`` consecutive ranks."""
    return cluster.intra if c.cp * c.pp * c.tp <= cluster.devices_per_node else cluster.inter


def _ep_link(cluster: Cluster, c: Candidate):
    """The link of an ep group: ``ep`` consecutive dp indices, ``ep·pp·tp`` consecutive ranks."""
    return cluster.intra if c.expert_parallel * c.pp * c.tp <= cluster.devices_per_node else cluster.inter


def _pp_link(cluster: Cluster, c: Candidate):
    if cluster.p2p is not None:
        return cluster.p2p
    return cluster.intra if c.pp * c.tp <= cluster.devices_per_node else cluster.inter


class CostModel:
    """Estimates for one model profile on one cluster, with the per-chunk sums cached."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, *, optimizer: str = "adam"):
        if optimizer not in OPTIMIZER_STATE:
            raise PlanError(f"unknown optimizer kind {optimizer!r}", where="planner(optimizer=...)",
                            fix=f"use one of {', '.join(OPTIMIZER_STATE)}")
        self.profile, self.cluster, self.optimizer = profile, cluster, optimizer
        self._tables: dict = {}
        self._params: dict = {}
        self._states: dict = {}
        self._transients: dict = {}
        self._chunk_costs: dict = {}

    # -- per-chunk sums -------------------------------------------------------------------
    def table(self, tp: int, b: int, recompute: str, device: Device, contention: float, ep: int = 1,
              ep_link=None, cp: int = 1, cp_link=None, cp_strategy: str = "ring"):
        """Prefix sums over chunks of (forward, backward, weight, tp comm, saved bytes, ep all-to-all, cp attention
        traffic) seconds/bytes (``ep`` > 1: the MoE layers' all-to-alls over ``ep_link``, in forward and backward;
        ``cp`` > 1: the attention's ring or all-to-alls over ``cp_link``)."""
        key = (tp, b, recompute, id(device), contention, ep, ep_link, cp, cp_link, cp_strategy)  # (self.cluster's)
        if key not in self._tables:
            rows = [[0.0] * 7]
            for ch in self.profile.chunks[tp]:
                f, bw, w = chunk_times(ch, b=b, tp=tp, device=device, cluster=self.cluster,
                                       precision=self.profile.precision, recompute=recompute, contention=contention,
                                       ep=ep, ep_link=ep_link, cp=cp, cp_link=cp_link, cp_strategy=cp_strategy)
                comm = sum(comm_time(ch.comms, tp=tp, b=b / cp, link=self.cluster.intra, direction=d,
                                      include_recompute=True) for d in ("forward", "backward"))
                attention = sum(cp_comm(ch, b=b, cp=cp, strategy=cp_strategy, link=cp_link or self.cluster.intra))
                a2a = sum(moe_comm(ch, b=b, ep=ep, link=ep_link or self.cluster.intra))
                if recompute == "full":
                    a2a += moe_comm(ch, b=b, ep=ep, link=ep_link or self.cluster.intra)[0]
                last = rows[-1]
                rows.append([last[0] + f, last[1] + bw, last[2] + w, last[3] + comm,
                             last[4] + ch.saved[recompute] * b / cp,
                             last[5] + a2a, last[6] + attention])
            self._tables[key] = rows
        return self._tables[key]

    def candidate_table(self, c: Candidate, device: Device, recompute: str | None = None):
        """:meth:`table` for candidate ``c`` on ``device``."""
        return self.table(c.tp, self._b(c), c.recompute if recompute is None else recompute, device,
                          self._contention(c), c.expert_parallel, self.ep_link(c), c.cp, self.cp_link(c),
                          c.cp_strategy)

    def cp_link(self, c: Candidate):
        """The link of ``c``'s cp groups (None with cp=1: no ring)."""
        return _cp_link(self.cluster, c) if c.cp > 1 else None

    def ep_link(self, c: Candidate):
        """The link of ``c``'s ep groups (None with ep=1: no all-to-all)."""
        return _ep_link(self.cluster, c) if c.expert_parallel > 1 else None

    def chunk_costs(self, c: Candidate) -> list[float]:
        """Time of one microbatch's forward and backward on each chunk (for placing stage boundaries)."""
        t = self.candidate_table(c, self.cluster.device)
        if id(t) not in self._chunk_costs:  # (tables live as long as the model: their ids stay theirs)
            self._chunk_costs[id(t)] = [sum(t[i + 1][k] - t[i][k] for k in range(3)) for i in range(len(t) - 1)]
        return list(self._chunk_costs[id(t)])

    def experts(self, tp: int) -> frozenset[str]:
        """The user names of the MoE expert tensors (split over ep when ep > 1)."""
        return frozenset(name for ch in self.profile.chunks[tp] for m in ch.moe for name in m.expert_params)

    def rank_params(self, tp: int, ranges: tuple, ep: int = 1) -> tuple[tuple[ParamEntry, ...], int, int, int]:
        """(parameters, buffer bytes, fp32 gradient bytes, parameter bytes) of a rank's stages, each once
        (the MoE expert tensors at ``1/ep`` of their experts)."""
        key = (tp, ranges, ep)
        if key not in self._params:
            seen, params, buffers = set(), [], 0
            experts = self.experts(tp) if ep > 1 else frozenset()
            for lo, hi in ranges:
                for ch in self.profile.chunks[tp][lo:hi]:
                    buffers += ch.buffer_bytes
                    params += [replace(p, numel=p.numel // ep) if p.name in experts else p
                               for p in ch.params if p.name not in seen]
                    seen.update(p.name for p in ch.params)
            grads = sum(p.numel for p in params if p.trainable) * 4
            self._params[key] = (tuple(params), buffers, grads, sum(p.numel * p.itemsize for p in params))
        return self._params[key]

    def expert_bytes(self, tp: int, ranges: tuple, ep: int) -> tuple[int, int]:
        """(fp32 gradient bytes, parameter bytes) of the expert tensors a rank holds (0 with ep=1: they
        are then parameters like any other)."""
        if ep == 1:
            return 0, 0
        experts = self.experts(tp)
        mine = [p for p in self.rank_params(tp, ranges, ep)[0] if p.name in experts]
        return sum(p.numel for p in mine if p.trainable) * 4, sum(p.numel * p.itemsize for p in mine)

    def states(self, tp: int, ranges: tuple, zero: int, dp: int, ep: int = 1, cp: int = 1):
        """(model-state bytes, elements stepped) of the fullest dp rank holding ``ranges`` (ZeRO over dp x cp)."""
        key = (tp, ranges, zero, dp, ep, cp)
        if key not in self._states:
            params, buffers, _, _ = self.rank_params(tp, ranges, ep)
            local = self.experts(tp) if ep > 1 else frozenset()
            self._states[key] = _states(params, buffers, zero, ParallelDims(dp=dp, cp=cp, ep=ep),
                                        self.profile.precision, self.optimizer, local)
        return self._states[key]

    def _transient(self, tp: int, recompute: str, chunk_range: tuple[int, int]) -> float:
        """The largest recomputation transient per sample of the chunks in ``chunk_range`` (cached)."""
        key = (tp, recompute, chunk_range)
        if key not in self._transients:
            lo, hi = chunk_range
            self._transients[key] = max((ch.transient[recompute] for ch in self.profile.chunks[tp][lo:hi]),
                                        default=0.0)
        return self._transients[key]

    def _b(self, c: Candidate) -> int:
        return self.profile.global_batch // (c.dp * c.num_microbatches)

    def _contention(self, c: Candidate) -> float:
        return self.cluster.contention(min(c.dcp * c.pp * c.tp, self.cluster.devices_per_node))

    def stage_devices(self, c: Candidate) -> list[Device]:
        """For each pp rank, the slowest device among the ranks that run it (every dp and tp index)."""
        if not self.cluster.groups:
            return [self.cluster.device] * c.pp
        out = []
        for q in range(c.pp):
            ranks = [(d * c.pp + q) * c.tp + t for d in range(c.dcp) for t in range(c.tp)]  # (cp inside dp)
            out.append(min((self.cluster.device_of(r) for r in ranks), key=lambda dev: dev.matmul_rate("fp32")))
        return out

    def _zero3_comm(self, c: Candidate, ranges, link, device: Device) -> float:
        """ZeRO-3: each unit's weights gathered in forward and again in backward, its gradients
        reduce-scattered, every microbatch; plus the copies into and out of the gathered buffers."""
        total = 0.0
        for lo, hi in ranges:
            for i in range(lo, hi):
                _, _, grads, params = self.rank_params(c.tp, ((i, i + 1),), c.expert_parallel)
                if grads == 0:
                    continue
                total += (2 * link.collective("all_gather", params, c.dcp)
                          + link.collective("reduce_scatter", grads, c.dcp)
                          + (2 * params + grads) / device.memory_bandwidth)
        return total * c.num_microbatches

    # -- one candidate --------------------------------------------------------------------
    def stage_times(self, c: Candidate):
        """Per stage: forward, input-gradient and weight-gradient seconds of a microbatch, and tp comm seconds."""
        schedule, _ = schedule_of(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
        devices = self.stage_devices(c)
        out = ([], [], [], [])
        for s, (lo, hi) in enumerate(_stage_ranges(c.cuts, self.profile.num_chunks)):
            device = devices[schedule.stage_to_rank[s]]
            t = self.candidate_table(c, device)
            for k in range(4):
                out[k].append(t[hi][k] - t[lo][k])
            if splits_backward(c.schedule) and s > 0:  # the first stage runs its backward whole (executor)
                out[2][-1] += device.split_backward_overhead * (out[1][-1] + out[2][-1])
        return out

    def pipeline_costs(self, c: Candidate) -> StageCosts:
        """The per-stage seconds of one microbatch and the p2p time the pipeline is simulated with."""
        chunks = self.profile.chunks[c.tp]
        ranges = _stage_ranges(c.cuts, len(chunks))
        fwd, bwd, wgt, _comm = self.stage_times(c)
        boundary = max((chunks[lo].recv_bytes for lo, _ in ranges[1:]), default=0.0) * self._b(c)
        p2p = _pp_link(self.cluster, c).p2p(boundary) if c.pp > 1 else 0.0
        return StageCosts(forward=fwd, backward=bwd, weight=wgt, p2p=p2p)

    def critical_path(self, c: Candidate):
        """The critical path of ``c``'s pipeline (its full schedule, lone-rank stage times: with ranks sharing
        cores the planner's figure comes from processor sharing, which has no single path)."""
        full = full_schedule(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
        return simulate(full, costs=self.pipeline_costs(c)).critical_path

    def estimate(self, c: Candidate, *, simulate_pipeline: bool = False) -> Estimate:
        """Step time and peak memory of ``c`` (its ``cuts`` must be set when pp x v > 1).

        ``simulate_pipeline``: the pipeline simulated on the full schedule; otherwise its lower bound
        (:func:`~autopar.planner.pipeline_bound.pipeline_lower_bound`), so that ``estimate(c).step_time``
        never exceeds ``estimate(c, simulate_pipeline=True).step_time``. One pp rank is always exact.
        """
        chunks = self.profile.chunks[c.tp]
        schedule, counts = schedule_of(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
        ranges = _stage_ranges(c.cuts, len(chunks))
        owner = schedule.stage_to_rank
        fwd, bwd, wgt, comm = self.stage_times(c)
        boundary = max((chunks[lo].recv_bytes for lo, _ in ranges[1:]), default=0.0) * self._b(c)
        p2p = _pp_link(self.cluster, c).p2p(boundary) if c.pp > 1 else 0.0
        work = [fwd[s] + bwd[s] + wgt[s] for s in range(len(ranges))]
        per_rank = [0.0] * c.pp
        for s, w in enumerate(work):  # (stage order within each rank, as a sum over its stages adds them)
            per_rank[owner[s]] += w
        simulated = simulate_pipeline or c.pp == 1
        busiest = max(range(c.pp), key=lambda q: per_rank[q])
        compute = per_rank[busiest] * c.num_microbatches
        pipeline = self._pipeline(c, owner, fwd, bwd, wgt, p2p, simulated)
        if self._contention(c) > 1 and c.pp > 1:  # a rank waiting lends its core: the bubble costs little
            compute = min(compute, pipeline)
        tp_comm = sum(comm[s] for s in stages_of(owner, c.pp)[busiest]) * c.num_microbatches
        ep_comm = self._column(c, ranges, owner, busiest, 5) if c.expert_parallel > 1 else 0.0
        cp_comm = self._column(c, ranges, owner, busiest, 6) if c.cp > 1 else 0.0
        dp_time, opt_time, (memory, parts, capacity) = self._ranks(c, ranges, owner, counts, schedule)
        overhead = self.cluster.step_overhead_s
        return Estimate(candidate=c, step_time=pipeline + dp_time + opt_time + overhead, simulated=simulated,
                        parts={"compute": compute - tp_comm - ep_comm - cp_comm, "tp_comm": tp_comm,
                               "ep_comm": ep_comm, "cp_comm": cp_comm,
                               "bubble": max(0.0, pipeline - compute), "p2p": p2p, "dp_comm": dp_time,
                               "optimizer": opt_time, "overhead": overhead},
                        memory=memory, memory_parts=parts, capacity=capacity)

    def _column(self, c: Candidate, ranges, owner, rank: int, column: int) -> float:
        """Seconds of a step's communication of one kind (the table's ``column``: 5 the MoE all-to-alls, 6 cp's
        attention traffic) on pp rank ``rank`` (part of its stage times), over the step's microbatches."""
        t = self.candidate_table(c, self.cluster.device)
        per_microbatch = sum(t[hi][column] - t[lo][column] for s, (lo, hi) in enumerate(ranges) if owner[s] == rank)
        return per_microbatch * c.num_microbatches

    def _pipeline(self, c: Candidate, owner, fwd, bwd, wgt, p2p, simulated: bool) -> float:
        """The pipeline's step in seconds: simulated on the full schedule, or its lower bound.

        Ranks sharing cores (contention ``k`` > 1, CPU processes): lone-rank costs (the contended
        ones over ``k``) plus the cluster's switch time per action (caches refilled after a wait), on
        the pipeline's ``pp / k`` cores, by processor sharing
        (:func:`~autopar.runtime.schedules.shared_cores.simulate_shared_cores`).
        """
        k = self._contention(c)
        split = splits_backward(c.schedule)
        cores = None
        if k > 1 and c.pp > 1:
            switch = self.cluster.shared_core_switch_s
            fwd, bwd = [x / k + switch for x in fwd], [x / k + switch for x in bwd]
            wgt, cores = [x / k + (switch if split else 0.0) for x in wgt], c.pp / k
        if simulated:
            full = full_schedule(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
            costs = StageCosts(forward=fwd, backward=bwd, weight=wgt, p2p=p2p)
            if cores is not None:
                return simulate_shared_cores(full, costs=costs, cores=cores, validated=True)
            return simulate(full, costs=costs, validated=True).step_time
        if not family(c.schedule).bounded:  # no bound proven for it: the trivial one
            return 0.0
        return pipeline_lower_bound(owner=owner, forward=fwd, backward=bwd, weight=wgt, p2p=p2p,
                                    num_microbatches=c.num_microbatches, split_backward=split, cores=cores)

    def _ranks(self, c: Candidate, ranges, owner, counts, schedule):
        """(exposed dp communication, optimizer step, (memory, parts, capacity) of the most over-full pp rank)."""
        b, devices = self._b(c), self.stage_devices(c)
        dp_link = _dp_link(self.cluster, c)
        worst, dp_time, opt_time = None, 0.0, 0.0
        for q, mine in enumerate(stages_of(owner, c.pp)):
            mine_ranges = tuple(ranges[s] for s in mine)
            _, _, grad_bytes, param_bytes = self.rank_params(c.tp, mine_ranges, c.expert_parallel)
            states, stepped = self.states(c.tp, mine_ranges, c.zero_stage, c.dp, c.expert_parallel, c.cp)
            if c.zero_stage == 3 and c.dcp > 1:  # one gather / reduce-scatter per unit and microbatch
                dp_time = max(dp_time, self._zero3_comm(c, [ranges[s] for s in mine], dp_link, devices[q]))
            else:
                expert = self.expert_bytes(c.tp, mine_ranges, c.expert_parallel)
                dp_time = max(dp_time, _dp_comm(c, grad_bytes, param_bytes, dp_link, self.cluster, expert=expert))
            opt_time = max(opt_time, stepped * _OPT_BYTES[self.optimizer] / devices[q].memory_bandwidth
                           * self._contention(c))  # every rank steps at once
            t = self.candidate_table(c, devices[q])
            per_stage = {s: t[ranges[s][1]][4] - t[ranges[s][0]][4] for s in mine}
            if c.num_virtual == 1:
                acts = counts[q] * per_stage[mine[0]]
            elif schedule.actions is None:  # closed form: each in-flight microbatch at the rank's largest stage
                acts = counts[q] * max(per_stage.values())
            else:
                acts = peak_bytes(schedule.actions[q], {**dict.fromkeys(range(len(ranges)), 0.0), **per_stage},
                                  split_backward=schedule.split_backward)
            transient = max((self._transient(c.tp, c.recompute, ranges[s]) for s in mine), default=0.0) * b / c.cp
            total = (states.params + states.master_params + states.grads + states.optimizer + states.buffers
                     + acts + transient)
            capacity = self.cluster.usable_bytes(q * c.tp)
            if worst is None or total - capacity > worst[0] - worst[2]:
                worst = (total, {"params": states.params + states.master_params, "grads": states.grads,
                                 "optimizer": states.optimizer, "activations": acts + transient,
                                 "buffers": states.buffers}, capacity)
        return dp_time, opt_time, worst


def estimate(c: Candidate, *, profile: ModelProfile, cluster: Cluster, optimizer: str = "adam",
             simulate_pipeline: bool = False) -> Estimate:
    """Step time and peak memory of candidate ``c`` (one-off; :class:`CostModel` caches across many)."""
    return CostModel(profile, cluster, optimizer=optimizer).estimate(c, simulate_pipeline=simulate_pipeline)


def _dp_comm(c: Candidate, grad_bytes: float, param_bytes: float, link, cluster: Cluster,
             expert: tuple[float, float] = (0, 0)) -> float:
    """Data-parallel gradient (and ZeRO-1/2 weight) traffic of a rank holding ``grad_bytes`` of gradients.

    ``expert``: (gradient, parameter) bytes of the MoE experts among them with ep > 1: outside ZeRO,
    their gradients are all-reduced over the ``dp / ep`` ranks that hold the same experts (edp)."""
    if c.dcp == 1:
        return 0.0
    grads, params = grad_bytes - expert[0], param_bytes - expert[1]
    if c.zero_stage == 0:
        t = link.collective("all_reduce", grads, c.dcp)
    else:
        t = link.collective("reduce", grads, c.dcp) + link.collective("broadcast", params, c.dcp)
    t += link.collective("all_reduce", expert[0], c.dims.edcp)
    return t * (1 - cluster.dp_overlap)
