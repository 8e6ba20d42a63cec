"""autopar's runtime: one rank's program, in the order a training step runs it (installed as ``autopar.runtime``).

The runtime reads the shared vocabulary (``autopar.ir``: graph names, node meta, shard layouts, the
captured and stage graphs), the ops the passes insert (``autopar.ops``), ``autopar.errors``,
``autopar.plan_model`` and ``autopar.parallel_dims``: never ``autopar.passes`` nor anything above it
(tests/test_import_graph.py). ``schedules/`` is its own package: schedules as data, generators, the
validator and the simulator; it reads nothing of the runtime, so the passes may read it too.

Building a rank's program::

    rank_context.py       MeshInfo, AxisGroup, RankContext (groups, deadline, log), the ProgramState Protocol
    materialize.py        a meta-built model's tensors made real, only the pieces this rank holds
    init_replay.py        the model's own initialisers replayed module by module (a filler)
    mixed_precision.py    bf16 compute, fp32 masters and gradients
    zero.py               the optimizer, its state sharded over dp (ZeRO-1/2/3)
    param_groups.py       the optimizer's parameter groups, learned once from the user's factory by name
    index_guard.py        token ids and positions range-checked before any stage reads them
    item_count.py         each microbatch's share of the step's label tokens (a model's own loss, a token-mean loss_fn)
    moe_groups.py         the ep and edp groups of expert parallelism, expert gradients over edp
    rank_parts.py         build_parts: this rank's stages, channel, parameters and optimizer
    program_surface.py    what every program kind shares: batches, forward only, weights, checkpoints
    step_report.py        program.last_step: loss, learning rates, gradient norm, tokens per second
    graft.py              stage graphs built for another batch shape, pointed at the compiled graphs' tensors

Running a step::

    step_batches.py       a step's microbatches, their stage graphs, the schedule, the dp agreement
    batch_split.py        a batch's rows checked and cut into microbatches (a partial batch: fewer or smaller)
    batch_agreement.py    every dp rank's rows and refusals on one all-reduce; row weights of a partial batch
    shape_cache.py        stage graphs per batch shape: compiled, their symbolic family, or built per shape
    program.py            RankProgram: the synchronous schedules' train_step
    executor.py           runs this rank's schedule actions on its stage graphs
    ddp_buckets.py        DDP's gradient buckets, reduced while backward runs
    grad_sync.py          gradient sync over dp and across stages (tied weights)
    tp_grad_sync.py       replicated parameters read on sequence shards: grads summed over tp
    numerics.py           a NaN/inf stops the step on every rank before the optimizer steps
    clip.py               clipping by the global norm over every shard and axis
    async_pipeline.py     AsyncProgram: PipeDream, 2BW, PipeMare as one endless stream
    weight_versions.py    an asynchronous stage's weight versions and pending updates
    data_parallel.py      DataParallelProgram: the rank-0 baseline

The weights out and back in::

    state.py              the program's weights gathered into one single-device state_dict
    rank_tensors.py       what this rank holds of the single-device model, and how it is cut
    unused_state.py       the model's tensors no stage graph reads, kept whole and never trained
    checkpoint_layout.py  layouts, pieces, split and join
    checkpoint_files.py   the folder per step, the latest pointer, the manifest, atomic publish
    rng_state.py          each rank's random state, restored or re-derived
    checkpoint.py         checkpoints that reshard: save on one mesh, load on another
    checkpoint_extra.py   what a checkpoint carries besides the model (a scheduler, any state_dict owner)

Measuring and seeing::

    memory_probe.py       bytes a rank holds, activations saved for backward
    model_state.py        measured model-state memory of one rank
    flight_watch.py       heartbeats, and the job-wide diagnosis every surviving rank writes
    diagnosis.py          every rank's flight record read together: who stopped the job and why
    stragglers.py         a rank computing markedly slower than its peers on the same stages
    trace.py              every rank's events as a Chrome trace and a timeline, and the bubble
"""
