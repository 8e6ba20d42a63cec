"""The planner: autopar chooses dp x pp x tp, microbatches, schedule, ZeRO stage, recompute and stage cuts.

A sketch (a 70B-shaped model on the meta device; tests/api/test_planner.py runs plans like it)::

    report = autopar.plan(model, 1024, plan="auto", cluster=get_cluster("a100-80g-8x", nodes=128),
                          example_inputs=(tokens,), loss_fn=lm_loss, example_target=targets,
                          ranks=[0]).planner
    print(report.table())       # ranked candidates: estimated step time, memory per rank
    print(report.summary())     # why the first one won

The parts, in the order they run: :mod:`~autopar.planner.profile` (per-chunk costs from the
captured graph), :mod:`~autopar.planner.cost_model` (step time and memory of one candidate, from the per-chunk times of
:mod:`~autopar.planner.chunk_time`, on the schedule shapes :mod:`~autopar.planner.schedule_shapes` caches),
:mod:`~autopar.planner.pipeline_bound` (the closed form, a proven lower bound of the simulated
pipeline), :mod:`~autopar.planner.stage_cuts` (stage boundaries for devices of any speed and memory),
:mod:`~autopar.planner.search` (best-first: the simulator's fastest fitting plan),
:mod:`~autopar.planner.reasons` (the ranked table, the reasons, batch warnings),
:mod:`~autopar.planner.precision` (an fp32 plan on GPUs says what bf16 would change),
:mod:`~autopar.planner.auto` (``plan="auto"``). :mod:`~autopar.planner.calibrate` measures this machine;
:mod:`~autopar.planner.published` and :mod:`~autopar.planner.published_fit` hold the GPU presets to
published large runs; :mod:`~autopar.planner.measured` sets an estimate beside a measured step time;
:mod:`~autopar.planner.rebalance` re-splits a running pipeline from measured stage times.
See docs/planner.md.
"""
from autopar.planner.auto import PlannerReport, choose_plan
from autopar.planner.cluster import CLUSTER_PRESETS, Cluster, Device, Link, NodeGroup, get_cluster, local_cluster
from autopar.planner.cost_model import Candidate, CostModel, Estimate
from autopar.planner.profile import ModelProfile, profile_model
from autopar.planner.candidates import SearchSpace
from autopar.planner.search import SearchResult, search
from autopar.planner.stage_cuts import weighted_cuts

__all__ = ["PlannerReport", "choose_plan", "Cluster", "Device", "Link", "NodeGroup", "CLUSTER_PRESETS",
           "get_cluster", "local_cluster", "Candidate", "CostModel", "Estimate", "ModelProfile", "profile_model",
           "SearchResult", "SearchSpace", "search", "weighted_cuts"]
