"""A rank's model and optimizer state: made real, sharded, synced, gathered back (``autopar.runtime.state``).

Parameters materialized, the optimizer (ZeRO), gradients synced over dp and tp, clipping, mixed
precision, and the weights gathered into one single-device state_dict.

Building::

    materialize.py        a meta-built model's tensors made real, only the pieces this rank holds
    mixed_precision.py    bf16 compute, fp32 masters and gradients
    zero.py               the optimizer, its state sharded over dp (ZeRO-1/2/3)
    param_groups.py       the optimizer's parameter groups, learned once from the user's factory by name
    moe_groups.py         the ep and edp groups of expert parallelism, expert gradients over edcp (edp x cp)

Gradients::

    ddp_buckets.py        DDP's gradient buckets, reduced while backward runs
    grad_sync.py          gradient sync over dp and across stages (tied weights)
    tp_grad_sync.py       replicated parameters read on sequence shards: grads summed over tp
    clip.py               clipping by the global norm over every shard and axis

The weights out::

    state.py              the program's weights gathered into one single-device state_dict
    rank_tensors.py       what this rank holds of the single-device model, and how it is cut
    unused_state.py       the model's tensors no stage graph reads, kept whole and never trained
    model_state.py        measured model-state memory of one rank
"""
