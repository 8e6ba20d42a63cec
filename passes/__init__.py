"""autopar's compiler passes, grouped by concern (installed as ``autopar.passes``).

A pass of the lowering takes a ``LoweringState`` and gives one back (``lowering_state.py``), with no
options of its own and no state kept between calls; analyses write ``node.meta`` (keys declared once in
``ir/meta_keys.py``) or state fields, transforms change the graph. ``autopar/lowering.py`` lists the
pipeline once (``passes()``) and runs it under ``pass_manager.py``; a module may also keep the
graph-level function its pass wraps, for the planner and the tests. The passes read the shared
vocabulary (``autopar.ir``), insert the ops of ``autopar.ops`` and read the schedule registry (pure
data): never an executor nor anything else of ``autopar.runtime`` (tests/test_import_graph.py).

Each concern is a sub-package with its own map (``autopar/lowering.py`` holds the order the passes run in)::

    frontend/             capture (nn.Module -> one ATen graph) and the analyses that write node.meta
    tp/                   tensor parallelism: regions, sharded weights, vocabulary and sequence parallel
    moe/                  MoE layers found, experts over ep ranks, expert tensor parallelism
    pipeline/             stage cuts, one graph per stage, split backward, Chimera's replica, recompute
    data_parallel/        ZeRO-3: gather each group of dp shards before use, free after
    context_parallel/     attention found in the graph, the sequence followed through it (analyses, not lowered yet)

Running passes::

    lowering_state.py     the one state every pass takes and returns
    pass_manager.py       runs the written-out pipeline, checks the graph after every pass
"""
