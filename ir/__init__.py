"""The shared vocabulary the compiler and the runtime both read (installed as ``autopar.ir``).

The types and names a rewritten program is made of, written once: the passes write them, the runtime
and the planner read them. This package imports nothing of autopar but ``autopar.errors``,
``autopar.plan_model`` and ``autopar.parallel_dims`` (tests/test_import_graph.py); the degrees and
groups of the mesh are ``autopar/parallel_dims.py``'s ``ParallelDims``, beside it.

The vocabulary::

    graph_names.py        MODEL_PREFIX, and a graph attribute's name as the user's model spells it
    meta_keys.py          the one registry of node.meta keys, their value types, writers and readers
    shard_layout.py       ShardLayout: how a tensor is cut over ranks (passes, Plan, runtime, checkpoints)
    dynamic_shapes.py     symbolic dims: DynamicDim, SizeExprs of edge shapes, a microbatch's sizes
    captured_graph.py     CapturedGraph, the captured program; ItemCount, the label-token inputs it reads
    stage_graph.py        StageGraph and Edge: the pipeline's stage programs and what flows between them
"""
