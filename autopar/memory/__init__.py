"""The model memory calculator: per-rank bytes of any plan, without allocating the model.

:func:`estimate_memory` takes an :class:`autopar.PlanResult` (from :func:`autopar.plan`, a
meta-device model included) and gives every rank's parameters, fp32 masters, gradients,
optimizer state, buffers and peak activations. ``docs/memory.md`` has the formulas.
"""
from autopar.memory.activations import StageActivations, peak_bytes, stage_activations
from autopar.memory.calculator import MemoryEstimate, RankMemory, estimate_memory
from autopar.memory.states import OPTIMIZER_STATE, state_figures

__all__ = ["estimate_memory", "MemoryEstimate", "RankMemory", "stage_activations", "StageActivations",
           "peak_bytes", "state_figures", "OPTIMIZER_STATE"]
