"""The one state every pass of the lowering takes and returns (``autopar/lowering.py`` lists the passes).

A pass is a function ``LoweringState -> LoweringState`` with no options of its own: what it needs is
in the state (the Plan, this rank's coordinates, what earlier passes made and found), and what it
makes or finds goes back into it with :func:`dataclasses.replace`. The pass manager
(:mod:`autopar.passes.pass_manager`) checks the graphs :meth:`LoweringState.graphs` names after every
pass. Analysis results are values the passes after them read: kept by name where a later transform
could rewrite the nodes they refer to, or found right before their consumer.

A pass runs on its own on a state made by :meth:`LoweringState.of_graph`:

    >>> import torch, torch.fx as fx
    >>> from autopar.plan_model import MeshShape
    >>> st = LoweringState.of_graph(fx.symbolic_trace(torch.nn.Linear(4, 4)), mesh=MeshShape(tp=2), tp_rank=1)
    >>> st.tp_rank, st.plan.mesh.tp, st.ep_rank, [label for label, _, _ in st.graphs()]
    (1, 2, 0, ['graph'])

This module holds no transform and imports none (every pass module may import it): the fields that
hold a pass module's own types say which in a comment.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.plan_model import AnalysisChoices, MeshShape, PipelinePlan, Plan

__all__ = ["LoweringState", "ModelSource"]


@dataclass(frozen=True)
class ModelSource:
    """What the user handed over: the model, one global batch (inputs in order, the target) and the loss."""

    model: Any  # nn.Module
    inputs: tuple  # the global batch's input tensors, in the forward's order
    target: Any = None
    loss_fn: Any = None
    keywords: tuple[str, ...] | None = None  # a dict batch: the forward's keyword names of ``inputs``
    own_loss: bool = False  # no loss_fn, a ``labels`` input: the model's own loss
    # {position in ``inputs`` (the target after them): dims} to capture symbolic (passes/frontend/dynamic_capture.py);
    # None: as the Plan's dynamic_shapes says (``seq``: the sequence dim of the batch's token inputs)
    dynamic: Mapping[int, tuple[int, ...]] | None = None


@dataclass(frozen=True)
class LoweringState:
    """What the passes hand each other, from the model to this rank's stage graphs."""

    # -- given: the Plan (every decision, resolved once: autopar/options.py) and where this rank sits
    plan: Plan
    pinned: bool = False  # the Plan was given: its stage starts, regions, vocabulary and expert shards as written
    options: AnalysisChoices = AnalysisChoices()  # what steers the analyses (CompileOptions is one)
    coords: Mapping[str, int] = field(default_factory=dict)  # this rank's mesh coordinates (tp, dp: its experts, cp)
    only: tuple[int, ...] | None = None  # build only these stage graphs (None: all)
    source: ModelSource | None = None
    # -- made once per model (the capture phase)
    schedule: Any = None  # the Plan's schedule, built and validated (runtime/schedules)
    template: Any = None  # BlockTemplate (passes/frontend/block_template.py): identical blocks captured once
    captured: Any = None  # CapturedGraph (passes/frontend/capture.py)
    example_args: tuple = ()  # the microbatch inputs (and extra inputs, and target) the graph runs on
    # -- the graph, and from the pipeline split on the stage graphs (StageGraph, passes/pipeline/pipeline_split.py)
    gm: fx.GraphModule | None = None
    stages: tuple | None = None
    # -- what the analyses found, each right before the pass that reads it
    vocab: Any = None  # VocabParallel (passes/tp/vocab_parallel.py): embedding, head and loss on vocabulary shards
    regions: tuple = ()  # TpRegion (passes/tp/tp_regions.py), found on the graph shard_tensor_parallel rewrites
    expert_regions: tuple = ()  # ExpertRegion (passes/moe/tp_expert.py): expert MLPs sharded over tp
    # -- what the transforms made (graph names)
    specs: Mapping[str, Any] = field(default_factory=dict)  # tp-sharded parameters -> ShardLayout
    partial_grads: tuple[str, ...] = ()  # replicated params read on sequence shards: grads summed over tp
    region_plans: tuple = ()  # TpRegionPlan of each tensor-parallel region (module paths)
    starts: tuple[str, ...] = ()  # the unit each stage after the first begins at
    shared: Mapping[str, tuple[int, ...]] | None = None  # {user name: stages reading it}, read before the split
    experts: tuple[str, ...] = ()  # the expert tensors split over ep (passes/moe/moe_expert_parallel.py)
    cp_inputs: tuple[tuple[str, int], ...] = ()  # inputs cut on the sequence over cp: (name, dim) (cp_shard.py)
    cp_seq_len: int = 0  # the whole sequence those inputs hold (0: no cp)
    cp_label_shifts: tuple[tuple[str, int, float], ...] = ()  # (input, k, fill): shifted by the runtime before the cut
    cp_attention: tuple[tuple[str, str], ...] = ()  # (module path, "ring" | "all_to_all") per attention, graph order

    @classmethod
    def of_graph(cls, gm: fx.GraphModule, *, mesh: MeshShape | None = None, example_inputs: tuple = (),
                 tp_rank: int = 0, dp_rank: int = 0, **plan) -> LoweringState:
        """A state holding ``gm`` alone, for running a pass on its own: the Plan of ``mesh`` with ``plan``'s
        fields (one microbatch a rank unless ``plan`` says otherwise)."""
        mesh = mesh or MeshShape()
        pipeline = plan.pop("pipeline", PipelinePlan())
        batch = plan.pop("global_batch_size", mesh.dp * pipeline.num_microbatches)
        return cls(plan=Plan(mesh=mesh, global_batch_size=batch, pipeline=pipeline, **plan), gm=gm,
                   example_args=tuple(example_inputs), coords={"dp": dp_rank, "pp": 0, "tp": tp_rank})

    @property
    def tp_rank(self) -> int:
        return self.coords.get("tp", 0)

    @property
    def ep_rank(self) -> int:
        """This rank's place among the ep ranks that split the MoE experts (its dp index's, ParallelDims)."""
        return self.plan.dims.index("ep", {"dp": self.coords.get("dp", 0)})

    @property
    def has_loss(self) -> bool:
        return self.captured is not None and self.captured.has_loss

    @property
    def mesh(self) -> MeshShape:
        return self.plan.mesh

    @property
    def num_microbatches(self) -> int:
        return self.plan.pipeline.num_microbatches

    @property
    def num_stages(self) -> int:
        return self.plan.mesh.pp * self.plan.pipeline.num_virtual

    def graphs(self):
        """(label, graph, example inputs or None for a stage graph) of every graph the state holds."""
        if self.stages is not None:
            return tuple((f"stage {s.stage}", s.gm, None) for s in self.stages)
        if self.gm is not None:
            return (("graph", self.gm, self.example_args),)
        return ()
