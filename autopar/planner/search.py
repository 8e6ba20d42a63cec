"""The search: every dp x pp x tp mesh, microbatch count, schedule, ZeRO stage and recompute mode.

Its answer is the fastest fitting candidate *under the simulator*, found without simulating them all:

1. *Structures* (mesh, microbatches, schedule, virtual stages, expert parallelism) are enumerated:
   tp divides a node's devices (so tensor-parallel collectives stay on the fast link), pp x virtual
   stages is at most the number of chunks, dp divides the global batch, ep is 1 and, for a model with
   recognised MoE layers, every ep dividing dp and each layer's experts. Each gets a lower bound on
   the step time of every plan it holds, whatever its ZeRO stage, recomputation or stage cuts
   (:func:`~autopar.planner.pipeline_bound.relaxed_bound` on the chunk costs without recomputation).
2. Best first, by lower bound: a structure taken from the queue is *expanded*: stage boundaries from
   :func:`autopar.planner.stage_cuts.weighted_cuts` on its chunk times (heavy first and last chunks,
   per-stage device speeds), every ZeRO stage and recompute mode, a variant that does not fit retried
   with memory-aware boundaries (stages sized to each device's memory), else rejected with the bytes
   it needs. Each fitting variant goes back into the queue with its closed-form estimate, a proven
   lower bound of its simulated time (:mod:`autopar.planner.pipeline_bound`). A candidate taken from
   the queue is simulated (:mod:`autopar.runtime.schedules.simulator`).
3. The search stops once no bound left in the queue beats the simulated times of the first
   ``exact_top`` rows (the first of them the choice, ties within 1% going to the simpler plan): what
   is left cannot be faster, so those rows are the simulator's own ranking of every fitting candidate.

:func:`~autopar.planner.reasons.explain` continues the same queue to find, for each decision, the
simulator's best alternative.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

from autopar.errors import AutoparError, PlanError
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import Candidate, CostModel, Estimate, _dp_comm, _dp_link
from autopar.planner.schedule_shapes import schedule_of
from autopar.planner.candidates import SearchSpace, divisors, stage_speeds, structures
from autopar.planner.pipeline_bound import relaxed_bound
from autopar.planner.profile import RECOMPUTE, ModelProfile
from autopar.planner.stage_cuts import memory_fits, weighted_cuts
from autopar.runtime.schedules.registry import splits_backward

__all__ = ["SearchResult", "search", "TIE"]

log = logging.getLogger(__name__)

GiB = 2**30
TIE = 0.01  # simulated times within 1% of each other rank the simpler plan first


@dataclass
class SearchResult:
    """The simulated candidates that fit (ranked), rejected ones with reasons, and every estimate made.

    ``ranked`` holds simulated figures only; its first ``exact_rows`` are the simulator's ranking of
    every fitting candidate (the rest of the queue is bounded below by ``floor`` seconds).
    ``num_simulated`` and ``simulate_seconds`` say what the search spent on the simulator,
    ``search_seconds`` the whole search (what :func:`explain` simulates afterwards is not counted).
    """

    frontier: "_Frontier" = field(repr=False)
    world: int = 1
    cluster: Cluster | None = None
    global_batch: int = 1
    search_seconds: float = 0.0
    num_simulated: int = 0
    simulate_seconds: float = 0.0

    @property
    def ranked(self) -> list[Estimate]:
        return _ranked([e for e in self.frontier.simulated.values() if e.fits])

    @property
    def rejected(self) -> list[tuple[Candidate, str]]:
        return self.frontier.rejected

    @property
    def estimates(self) -> dict:
        """Candidate (cuts cleared) -> closed-form Estimate (a lower bound of the simulated one)."""
        return self.frontier.estimates

    @property
    def simulated(self) -> dict:
        """Candidate (cuts cleared) -> simulated Estimate."""
        return self.frontier.simulated

    @property
    def floor(self) -> float:
        """The lowest bound of anything not yet simulated (inf when everything was)."""
        return self.frontier.floor()

    @property
    def exact_rows(self) -> int:
        return _exact_rows(self.ranked, self.floor)

    @property
    def best(self) -> Estimate:
        ranked = self.ranked
        if not ranked:
            raise PlanError("no candidate plan fits the cluster", where="autopar planner",
                            fix="use more devices, bf16, a smaller batch, or see the rejected plans: "
                                + "; ".join(f"{c.label()}: {r}" for c, r in self.rejected[:3]))
        return ranked[0]

    @property
    def cost_model(self) -> CostModel:
        return self.frontier.model

    def best_where(self, structure_ok, candidate_ok) -> Estimate | None:
        """The simulator's fastest fitting candidate for which ``candidate_ok(candidate)`` holds
        (``structure_ok(structure)``: whether a structure can hold one), simulating best-first."""
        return self.frontier.best_where(structure_ok, candidate_ok)

    def simulate(self, e: Estimate) -> Estimate:
        """``e``'s candidate with its pipeline simulated (cached)."""
        return self.frontier.simulate(e)

    def evaluate(self, c: Candidate) -> Estimate:
        """The closed-form estimate of ``c`` (its stage cuts placed as the search places them)."""
        return self.frontier.evaluate(c)


@dataclass(order=True)
class _Item:
    bound: float
    seq: int
    structure: bool = field(compare=False)
    payload: object = field(compare=False)  # the structure's Candidate, or a candidate's closed-form Estimate

    @property
    def candidate(self) -> Candidate:
        return self.payload if self.structure else self.payload.candidate


class _Frontier:
    """The queue of unexpanded structures and unsimulated fitting candidates, by lower bound."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, space: SearchSpace, optimizer: str):
        self.profile, self.cluster, self.space = profile, cluster, space
        self.model = CostModel(profile, cluster, optimizer=optimizer)
        self.cuts = _Cuts(self.model)
        self.heap: list[_Item] = []
        self.count = itertools.count()
        self.estimates: dict = {}
        self.simulated: dict = {}
        self.rejected: list = []
        self.structures: list[Candidate] = []  # every structure enumerated
        self.simulate_seconds = 0.0
        self.work_cache: dict = {}  # _structure_bound's per-chunk sums, shared by structures

    def floor(self) -> float:
        return self.heap[0].bound if self.heap else float("inf")

    def push(self, bound: float, structure: bool, payload) -> None:
        heapq.heappush(self.heap, _Item(bound, next(self.count), structure, payload))

    def evaluate(self, c: Candidate, fits=None) -> Estimate:
        c = replace(c, cuts=self.cuts(c, fits))
        key = replace(c, cuts=())
        if fits is None and key in self.estimates:
            return self.estimates[key]
        e = self.model.estimate(c)
        self.estimates[key] = e
        return e

    def simulate(self, e: Estimate) -> Estimate:
        key = replace(e.candidate, cuts=())
        if key not in self.simulated:
            start = time.perf_counter()
            self.simulated[key] = self.model.estimate(e.candidate, simulate_pipeline=True)
            self.simulate_seconds += time.perf_counter() - start
        return self.simulated[key]

    def process(self, item: _Item) -> None:
        if item.structure:
            self.expand(item.payload)
        else:
            self.simulate(item.payload)

    def run(self, rows: int) -> None:
        """Expand and simulate best-first until the first ``rows`` ranked rows are exact."""
        while self.heap:
            fitting = _ranked([e for e in self.simulated.values() if e.fits])
            if fitting and _exact_rows(fitting, self.heap[0].bound) >= rows:
                return
            self.process(heapq.heappop(self.heap))

    def best_where(self, structure_ok, candidate_ok) -> Estimate | None:
        while True:
            best = min((e for e in self.simulated.values() if e.fits and candidate_ok(e.candidate)),
                       key=lambda e: e.step_time, default=None)
            pending = [it for it in self.heap
                       if (structure_ok(it.candidate) if it.structure else candidate_ok(it.candidate))]
            if not pending:
                return best
            top = min(pending)
            if best is not None and top.bound >= best.step_time:
                return best
            self.heap.remove(top)
            heapq.heapify(self.heap)
            self.process(top)

    def add_structure(self, c: Candidate) -> None:
        self.structures.append(c)
        self.push(_structure_bound(self.model, c, self.space.zero_stages, self.work_cache), True, c)

    def expand(self, c: Candidate) -> None:
        """Every ZeRO stage and recompute mode of structure ``c``: the fitting ones join the queue."""
        space, profile, cluster = self.space, self.profile, self.cluster
        zero = max(space.zero_stages) if c.dcp > 1 else 0
        if zero == 3 and (splits_backward(c.schedule) or c.expert_parallel > 1):  # (see constraint)
            zero = max([z for z in space.zero_stages if z < 3], default=3)
        frugal = replace(c, zero_stage=zero, recompute="full" if "full" in space.recompute else space.recompute[-1])
        try:
            e = self.evaluate(frugal)
            if not e.fits and c.num_stages > 1:  # stages sized to each rank's memory
                e = self.evaluate(frugal, fits=memory_fits(frugal, profile, cluster))
        except AutoparError as exc:
            self.rejected.append((c, exc.what))
            return
        if not e.fits:
            self.rejected.append((frugal, "does not fit even with ZeRO-3 and full recompute: " + _memory_reason(e)))
            return
        for zero in (space.zero_stages if c.dcp > 1 else (0,)):
            for rc in space.recompute:
                cand = replace(c, zero_stage=zero, recompute=rc)
                reason = constraint(cand)
                if reason:
                    self.rejected.append((cand, reason))
                    continue
                try:
                    e = self.evaluate(cand)
                    if not e.fits and cand.num_stages > 1:
                        e = self.evaluate(cand, fits=memory_fits(cand, profile, cluster))
                except AutoparError as exc:
                    self.rejected.append((cand, exc.what))
                    continue
                if e.fits:
                    self.push(e.step_time, False, e)
                else:
                    self.rejected.append((e.candidate, _memory_reason(e)))


def constraint(c: Candidate) -> str | None:
    """Why the runtime refuses (or the planner cannot cost yet) ``c``'s schedule, ZeRO, recompute and ep."""
    if c.zero_stage == 3 and c.dcp > 1 and splits_backward(c.schedule):
        return (f"ZeRO-3 does not combine with {c.schedule}: its W action computes weight gradients outside the "
                f"graph's reduce-scatter")
    if c.zero_stage == 3 and c.expert_parallel > 1:
        return (f"the planner does not cost ZeRO-3 of expert tensors over dp/ep yet (expert_parallel="
                f"{c.expert_parallel}; compile runs it when asked, docs/moe.md)")
    if c.recompute == "selective" and splits_backward(c.schedule):
        return f"selective recompute does not combine with {c.schedule}: its W action walks each recomputed region " \
               f"a second time"
    return None


def _structure_bound(model: CostModel, c: Candidate, zero_stages, work_cache: dict | None = None) -> float:
    """A lower bound on the step time of every plan of structure ``c``: any ZeRO stage (the least data-parallel
    communication of them, the optimizer step counted as 0), any recomputation (none is the cheapest), any
    stage cuts (relaxed), every chunk at its fastest device."""
    b, k = model.profile.global_batch // (c.dp * c.num_microbatches), model._contention(c)
    key = (c.tp, b, k, c.expert_parallel, id(model.ep_link(c)), c.cp, id(model.cp_link(c)), c.cp_strategy,
           splits_backward(c.schedule))
    cache = {} if work_cache is None else work_cache  # (structures share them: the search keeps one)
    if key not in cache:
        cache[key] = _fastest_work(model, c.tp, b, k, c.expert_parallel, model.ep_link(c), key[-1], c.cp,
                                   model.cp_link(c), c.cp_strategy)
    work, path = cache[key]
    m = c.num_microbatches
    lone = k if (k > 1 and c.pp > 1) else 1.0  # ranks sharing cores: a rank runs at most at its lone speed
    pipeline = max(m * work / c.pp, relaxed_bound(path=path / lone, work=work / lone, num_ranks=c.pp,
                                                  num_microbatches=m, num_virtual=c.num_virtual))
    return pipeline + _dp_bound(model, c, zero_stages) + model.cluster.step_overhead_s


def _fastest_work(model: CostModel, tp: int, b: int, k: float, ep: int, ep_link, split: bool, cp: int = 1,
                  cp_link=None, cp_strategy: str = "ring") -> tuple[float, float]:
    """(all the work, the critical path's share of it) of one microbatch through every chunk at its fastest
    device (:func:`_structure_bound`)."""
    devices = {id(d): d for d in (model.cluster.device, *(g.device for g in model.cluster.groups))}
    tables = [model.table(tp, b, "none", d, k, ep, ep_link, cp, cp_link, cp_strategy) for d in devices.values()]
    work = path = 0.0
    for i in range(model.profile.num_chunks):
        f, bw, w = (min(t[i + 1][j] - t[i][j] for t in tables) for j in range(3))
        work += f + bw + w
        path += f + bw + (0.0 if split else w)
    return work, path


def _dp_bound(model: CostModel, c: Candidate, zero_stages) -> float:
    """The least data-parallel communication of any ZeRO stage of ``c``: the busiest pp rank holds at least
    a ``1/pp`` share of the gradients and weights, and the alpha-beta times grow with the bytes."""
    if c.dcp == 1:
        return 0.0
    whole = ((0, model.profile.num_chunks),)
    _, _, grads, params = model.rank_params(c.tp, whole, c.expert_parallel)
    grads, params = grads / c.pp, params / c.pp
    expert = tuple(x / c.pp for x in model.expert_bytes(c.tp, whole, c.expert_parallel))
    link, cluster = _dp_link(model.cluster, c), model.cluster
    times = []
    for zero in zero_stages:
        if zero == 3:  # per unit and microbatch, at least as much as one transfer of all of them
            times.append(c.num_microbatches * (2 * link.collective("all_gather", params, c.dcp)
                                               + link.collective("reduce_scatter", grads, c.dcp)))
        else:
            times.append(_dp_comm(replace(c, zero_stage=zero), grads, params, link, cluster, expert=expert))
    return min(times, default=0.0)


def search(profile: ModelProfile, cluster: Cluster, *, world: int, space: SearchSpace = SearchSpace(),
           optimizer: str = "adam") -> SearchResult:
    """Rank the candidate plans for ``world`` ranks of ``cluster``: the first is the simulator's fastest.

    Context parallelism (``space.cp`` None) is searched only when no plan fits without it: every cp dividing the
    world whose 2 x cp divides the example's sequence then joins cp=1 (the refusals of the first search kept).
    """
    if space.cp is not None:
        return _search(profile, cluster, world=world, space=space, optimizer=optimizer)
    result = _search(profile, cluster, world=world, space=replace(space, cp=(1,)), optimizer=optimizer)
    wider = tuple(cp for cp in divisors(world) if cp > 1 and profile.seq_len and profile.seq_len % (2 * cp) == 0)
    if result.ranked or not wider:
        return result
    log.info("planner search: no plan fits without context parallelism; searching cp in %s", wider)
    return _search(profile, cluster, world=world, space=replace(space, cp=(1, *wider)), optimizer=optimizer)


def _search(profile: ModelProfile, cluster: Cluster, *, world: int, space: SearchSpace,
            optimizer: str) -> SearchResult:
    start = time.perf_counter()
    frontier = _Frontier(profile, cluster, space, optimizer)
    for c in structures(world, profile, cluster, space, frontier.rejected):
        frontier.add_structure(c)
    frontier.run(max(1, space.exact_top))
    result = SearchResult(frontier=frontier, world=world, cluster=cluster, global_batch=profile.global_batch,
                          search_seconds=time.perf_counter() - start, num_simulated=len(frontier.simulated),
                          simulate_seconds=frontier.simulate_seconds)
    log.info("planner search: %d closed-form estimates, %d simulated (%.2f s) in %.2f s", len(frontier.estimates),
             result.num_simulated, result.simulate_seconds, result.search_seconds)
    return result


class _Cuts:
    """Stage boundaries per (tp, microbatch size, recompute, stages, speeds), cached."""

    def __init__(self, model: CostModel):
        self.model, self.cache = model, {}

    def __call__(self, c: Candidate, fits=None) -> tuple[int, ...]:
        if c.num_stages == 1:
            return ()
        schedule, _ = schedule_of(c.schedule, c.pp, c.num_microbatches, c.num_virtual)
        speeds = stage_speeds(self.model.cluster, c, schedule.stage_to_rank)
        key = (c.tp, c.dp * c.num_microbatches, c.recompute, c.num_stages, speeds, c.cp, c.cp_strategy)
        if fits is None and key in self.cache:
            return self.cache[key]
        cuts = tuple(weighted_cuts(self.model.chunk_costs(c), c.num_stages, speeds=speeds, fits=fits))
        if fits is None:
            self.cache[key] = cuts
        return cuts


def _ranked(estimates: list[Estimate], *, tie: float = TIE) -> list[Estimate]:
    """Fastest first; a run of estimates within ``tie`` of its fastest is ordered simplest first
    (less ZeRO, less recomputation, fewer virtual stages, less ep): the model cannot tell them apart."""
    ordered = sorted(estimates, key=lambda e: e.step_time)
    out, i = [], 0
    while i < len(ordered):
        j = i
        while j < len(ordered) and ordered[j].step_time <= ordered[i].step_time * (1 + tie):
            j += 1
        out += sorted(ordered[i:j], key=lambda e: (e.candidate.zero_stage, RECOMPUTE.index(e.candidate.recompute),
                                                   e.candidate.num_virtual, e.candidate.expert_parallel,
                                                   e.step_time))
        i = j
    return out


def _exact_rows(ranked: list[Estimate], floor: float, *, tie: float = TIE) -> int:
    """How many leading rows of ``ranked`` no unsimulated candidate (each at least ``floor``) can
    join or precede: the tie groups of :func:`_ranked` whose fastest is under ``floor / (1 + tie)``."""
    rows, i = 0, 0
    while i < len(ranked):
        start = ranked[i].step_time
        if start * (1 + tie) >= floor:
            break
        j = i
        while j < len(ranked) and ranked[j].step_time <= start * (1 + tie):
            j += 1
        rows, i = j, j
    return rows


def fmt_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps a digit before the point (GiB, MiB, KiB)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _memory_reason(e: Estimate) -> str:
    return (f"needs {fmt_bytes(e.memory)} on its fullest rank, has {fmt_bytes(e.capacity)} "
            f"(activations {fmt_bytes(e.memory_parts.get('activations', 0))}, "
            f"optimizer state {fmt_bytes(e.memory_parts.get('optimizer', 0))})")
