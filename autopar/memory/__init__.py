"""The model memory calculator: per-rank bytes of any plan, without allocating the model.

:func:`estimate_memory` takes an :class:`autopar.PlanResult` (from :func:`autopar.plan`, a
meta-device model included) and gives every rank's parameters, fp32 masters, gradients,
optimizer state, buffers and peak activations. :func:`memory_formula` writes the same bytes as sympy
formulas of the microbatch size and the sequence length, and :func:`longest_sequence` /
:func:`largest_microbatch` solve them for a device. ``docs/memory.md`` has the formulas.
"""
from autopar.memory.activations import StageActivations, peak_bytes, stage_activations
from autopar.memory.calculator import MemoryEstimate, RankMemory, estimate_memory
from autopar.memory.formula import MemoryFormula, memory_formula
from autopar.memory.solve import largest_microbatch, longest_sequence
from autopar.memory.states import OPTIMIZER_STATE, state_figures

__all__ = ["estimate_memory", "MemoryEstimate", "RankMemory", "stage_activations", "StageActivations",
           "peak_bytes", "state_figures", "OPTIMIZER_STATE", "memory_formula", "MemoryFormula", "longest_sequence",
           "largest_microbatch"]
