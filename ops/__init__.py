"""autopar's graph ops, differentiable and visible in a printed graph (installed as ``autopar.ops``).

Every collective, send and receive a pass inserts is a call to one of these modules (a ``call_module``
node), so a person reads where communication happens and a test counts it; the runtime binds their
groups and runs them. The passes and the runtime both import this package; it imports nothing of autopar
but itself, the shared vocabulary (``autopar.ir``), ``autopar.errors``, ``autopar.plan_model`` and
``autopar.parallel_dims`` (tests/test_import_graph.py). ``context_parallel/`` is its own package: the cp
layout and the ring and all-to-all attention ops (no pass inserts them yet).

The ops the passes insert into graphs::

    collectives.py        differentiable tp/sp collectives as visible call_module nodes
    tp_ops.py             tensor-parallel ops that communicate inside their computation
    tp_reduce_ops.py      the all-reduce of a reduction over a tp shard (a norm over every head)
    tp_rng.py             per-tp-rank random streams (Megatron's tracker)
    p2p.py                send/recv nodes between stages, and the channel they run over
    zero3_ops.py          ZeRO-3's gather/free nodes
    moe_ops.py            MoE dispatch/combine all-to-all nodes, and the dp-mean of router statistics
    recompute.py          Recompute: a checkpointed region (full / selective), one call_module node

What every collective runs through::

    comm_guard.py         a deadline on every collective, and the error naming a missed one
    comm_audit.py         counted dp collectives, and the bytes ZeRO's theory predicts
    flight_record.py      each rank's ring buffer of its last actions, collectives and transfers

Context parallelism (its own package)::

    context_parallel/     the cp layout, ring and all-to-all attention ops
"""
