"""autopar's compiler passes, in the order a model flows through them (installed as ``autopar.passes``).

A pass of the lowering takes a ``LoweringState`` and gives one back (``lowering_state.py``), with no
options of its own and no state kept between calls; analyses write ``node.meta`` (keys declared once in
``ir/meta_keys.py``) or state fields, transforms change the graph. ``autopar/lowering.py`` lists the
pipeline once (``passes()``) and runs it under ``pass_manager.py``; a module may also keep the
graph-level function its pass wraps, for the planner and the tests. The passes read the shared
vocabulary (``autopar.ir``), insert the ops of ``autopar.ops`` and read the schedule registry (pure
data): never an executor nor anything else of ``autopar.runtime`` (tests/test_import_graph.py).

Capture::

    capture.py            nn.Module (+ loss) -> one flat ATen graph (torch.export, or symbolic_trace)
    capture_model.py      the capture pass: the model (bf16 copy, block template) captured into the state
    dynamic_capture.py    the sequence dim captured symbolic (torch.export's Dim.AUTO), the dims it found
    devices.py            devices baked into the graph retargeted (meta constants -> CPU)
    low_precision.py      precision="bf16": the bf16 copy of the model that capture traces
    block_template.py     identical blocks: capture a few, repeat the last one after sharding

Analyses and checks (node.meta, nothing rewritten)::

    shape_prop.py         shapes and dtypes, by running the graph on fake tensors
    annotate.py           shapes, FLOPs, bytes, module paths, parameter ownership
    index_bounds.py       which inputs index a table, and how far (the runtime's index guard reads it)
    seq_bounds.py         the longest sequence a symbolic graph takes (export's range, position tables, config)
    symbolic_sizes.py     size nodes recomputed per stage; edge shapes fit as SizeExprs of the symbols
    batch_stats.py        refuse batch statistics over part of the batch (BatchNorm, dp > 1)
    static_shapes.py      refuse data-dependent output shapes
    item_count.py         where the model's own loss counts its label tokens (num_items_in_batch)
    mean_loss.py          a loss_fn that is a token mean: each microbatch's loss weighed by its tokens

Tensor parallelism (before the split, so a region's linears share a stage)::

    tp_select.py          analyses right before their rewrite: the vocabulary choice, tp and expert regions
    moe_detect.py         MoE layers found in the graph: router, top-k, experts, combine, aux loss
    moe_aux.py            the router's load-balancing statistics averaged over dp (aux loss as one device)
    moe_expert_parallel.py experts split over ep ranks, all-to-all dispatch and combine nodes
    tp_errors.py          NoRule: an op that cannot run on shards as placed
    tp_rules.py           placement rules per op family, as data
    tp_regions.py         regions found by propagating placements from candidate linears
    tp_projection.py      projections (linear, addmm/mm/matmul, a transposed weight): the candidates
    tp_fused_blocks.py    unequal fused blocks read by a split; one kv head broadcast to its query heads
    tp_gather_output.py   columns no row closes (and convolutions) sharded, their output all-gathered
    tp_expert_rules.py    placement rules of grouped expert products (one table entry each)
    tp_reduce_rules.py    a mean/sum over the sharded dim: a partial sum, all-reduced over tp (q/k norms)
    tp_pullback_rules.py  a shard pulled back through elementwise ops and table lookups (position tables)
    tp_inplace_rules.py   a tensor allocated and filled in place (new_empty + copy_ into slices)
    tp_expert.py          expert tensor parallelism: each expert's MLP column/row-sharded over tp
    tp_coverage.py        say what stays replicated because no rule covers it
    tensor_parallel.py    shard the regions' weights, insert Megatron's f and g
    vocab_parallel.py     embedding, LM head and loss on vocabulary shards
    sequence_parallel.py  the replicated stretches between regions sharded on the sequence
    tp_random.py          random ops on shards draw from the tp rank's own stream

Pipeline (the graph becomes stage graphs)::

    partition.py          cost-balanced stage cuts at block boundaries
    pipeline_split.py     one GraphModule per stage, joined by visible send/recv nodes
    weight_grad_split.py  zero-bubble schedules: every weight use exposed for a split backward
    chimera_replicate.py  Chimera: a second replica of every stage, re-addressed
    recompute.py          checkpointed block regions (full / selective)
    zero3.py              ZeRO-3: gather each group of dp shards before use, free after

Context parallelism (``context_parallel/``, its own package; analyses only, not in the lowering yet)::

    context_parallel/     attention found in the graph (masks evaluated on probes), the sequence followed through it

Running and reading passes::

    lowering_state.py     the one state every pass takes and returns
    pass_manager.py       runs the written-out pipeline, checks the graph after every pass
    collective_audit.py   every collective a rewritten graph does, with its bytes
"""
