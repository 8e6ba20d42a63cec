"""autopar: a graph-rewriting compiler that parallelises PyTorch models over dp x pp x tp meshes.

    program = autopar.compile(model, autopar.init_mesh(dp=2, pp=2, tp=2),
                              example_inputs=(tokens,), loss_fn=loss, example_target=targets)
    loss = program.train_step(program.shard_batch(tokens), target=program.shard_batch(targets))

``autopar.plan(model, {"dp": 2, "pp": 2, "tp": 2}, ...)`` gives the Plan and every rank's
rewritten graphs in a plain process.
"""
from autopar.compile import compile, default_optimizer
from autopar.coverage_report import CoverageReport, WeightCoverage, coverage, coverage_by_tp
from autopar.errors import (
    AutoparError, CaptureError, CheckpointError, IndexRangeError, InputError, NumericsError, PassError, PlanError, RuntimeCommError,
    ScheduleError, ShardingError,
)
from autopar.mesh import init_mesh
from autopar.options import CompileOptions
from autopar.plan_model import MeshShape, Plan
from autopar.planning import PlanResult, plan
from autopar.runtime.execution.step_report import StepReport

__all__ = [
    "compile", "plan", "init_mesh", "default_optimizer", "Plan", "PlanResult", "MeshShape",
    "coverage", "coverage_by_tp", "CoverageReport", "WeightCoverage", "StepReport",
    "CompileOptions", "AutoparError", "CaptureError", "PlanError", "ShardingError", "ScheduleError",
    "RuntimeCommError", "NumericsError", "IndexRangeError", "InputError", "CheckpointError", "PassError",
]
__version__ = "0.1.0"
