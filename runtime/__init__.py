"""autopar's runtime: one rank's program, grouped by concern (installed as ``autopar.runtime``).

The runtime reads the shared vocabulary (``autopar.ir``: graph names, node meta, shard layouts, the
captured and stage graphs), the ops the passes insert (``autopar.ops``), ``autopar.errors``,
``autopar.plan_model`` and ``autopar.parallel_dims``: never ``autopar.passes`` nor anything above it
(tests/test_import_graph.py). ``schedules/`` reads nothing of the runtime (schedules as data, generators,
the validator and the simulator), so the passes may read it too.

Each concern is a sub-package with its own map::

    execution/            a rank's program built and its steps run: batches, the schedule's executor, the step's report
    state/                the model and optimizer state: materialized, ZeRO, gradient sync, clipping, gathered back
    checkpoints/          checkpoints that reshard: layouts, files, random state, save and load
    diagnostics/          memory probes, heartbeats and the job-wide diagnosis, stragglers
    schedules/            schedules as data: actions, generators, the validator and the simulator
"""
