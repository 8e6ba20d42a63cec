"""Running a rank's program: its parts built, a step's batches cut, the schedule run (``autopar.runtime.execution``).

The program kinds (``RankProgram``, ``AsyncProgram``, ``DataParallelProgram``) and everything a step runs
through: the executor, the batch split and agreement, the stage graphs per shape, the checks and the step's
report.

Building a rank's program::

    rank_context.py       MeshInfo, AxisGroup, RankContext (groups, deadline, log), the ProgramState Protocol
    rank_parts.py         build_parts: this rank's stages, channel, parameters and optimizer
    init_replay.py        the model's own initialisers replayed module by module (a filler)
    index_guard.py        token ids and positions range-checked before any stage reads them
    item_count.py         each microbatch's share of the step's label tokens (a model's own loss, a token-mean loss_fn)
    program_surface.py    what every program kind shares: batches, forward only, weights, checkpoints
    step_report.py        program.last_step: loss, learning rates, gradient norm, tokens per second
    graft.py              stage graphs built for another batch shape, pointed at the compiled graphs' tensors

Running a step::

    step_batches.py       a step's microbatches, their stage graphs, the schedule, the dp agreement
    batch_split.py        a batch's rows checked and cut into microbatches (a partial batch: fewer or smaller)
    batch_agreement.py    every dp rank's rows and refusals on one all-reduce; row weights of a partial batch
    cp_batch.py           context parallelism: this rank's part of each sequence, forward outputs joined over cp
    shape_cache.py        stage graphs per batch shape: compiled, their symbolic family, or built per shape
    program.py            RankProgram: the synchronous schedules' train_step
    executor.py           runs this rank's schedule actions on its stage graphs
    numerics.py           a NaN/inf stops the step on every rank before the optimizer steps
    async_pipeline.py     AsyncProgram: PipeDream, 2BW, PipeMare as one endless stream
    data_parallel.py      DataParallelProgram: the rank-0 baseline
    weight_versions.py    an asynchronous stage's weight versions and pending updates
    trace.py              every rank's events as a Chrome trace and a timeline, and the bubble
"""
