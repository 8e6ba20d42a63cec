"""Pipeline schedules as data: actions, generators, a validator and a simulator. No process group needed.

    >>> from autopar.runtime.schedules import StageCosts, build_schedule, simulate
    >>> schedule = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    >>> result = simulate(schedule, costs=StageCosts(forward=1, backward=1, weight=0))
    >>> round(result.mean_bubble, 4), result.critical_path.length == result.step_time
    (0.2727, True)
"""
from autopar.runtime.schedules.action import Action, ActionKind, Schedule
from autopar.runtime.schedules.asynchronous import pipedream, pipedream_2bw, pipemare
from autopar.runtime.schedules.chimera import chimera
from autopar.runtime.schedules.deps import dependencies
from autopar.runtime.schedules.dualpipe import dualpipev
from autopar.runtime.schedules.forward_only import forward_only
from autopar.runtime.schedules.gpipe import gpipe
from autopar.runtime.schedules.interleaved import interleaved_1f1b, looped_bfs
from autopar.runtime.schedules.naive import naive
from autopar.runtime.schedules.one_f_one_b import one_f_one_b
from autopar.runtime.schedules.registry import ASYNC_SCHEDULES, build_schedule, schedule_names
from autopar.runtime.schedules.simulator import Event, SimResult, StageCosts, simulate
from autopar.runtime.schedules.staleness import StalenessRule
from autopar.runtime.schedules.step_graph import CriticalPath, critical_path, step_graph
from autopar.runtime.schedules.validator import validate
from autopar.runtime.schedules.zb_v import zb_v
from autopar.runtime.schedules.zero_bubble import zb_h1, zb_h2

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "dependencies",
    "naive",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "looped_bfs",
    "zb_h1",
    "zb_h2",
    "zb_v",
    "dualpipev",
    "chimera",
    "pipedream",
    "pipedream_2bw",
    "pipemare",
    "ASYNC_SCHEDULES",
    "StalenessRule",
    "forward_only",
    "build_schedule",
    "schedule_names",
    "validate",
    "StageCosts",
    "SimResult",
    "Event",
    "simulate",
    "step_graph",
    "critical_path",
    "CriticalPath",
]
