"""Tensor parallelism: regions found, weights sharded, vocabulary and sequence split (``autopar.passes.tp``).

Runs before the pipeline split, so a region's linears share a stage. Expert tensor parallelism is in
``autopar.passes.moe``; ``collective_audit.py`` reads every collective a rewritten graph does.

Finding the regions::

    tp_select.py          analyses right before their rewrite: the vocabulary choice, tp and expert regions
    tp_errors.py          NoRule: an op that cannot run on shards as placed
    tp_rules.py           placement rules per op family, as data
    tp_regions.py         regions found by propagating placements from candidate linears
    tp_projection.py      projections (linear, addmm/mm/matmul, a transposed weight): the candidates
    tp_fused_blocks.py    unequal fused blocks read by a split; one kv head broadcast to its query heads
    tp_gather_output.py   columns no row closes (and convolutions) sharded, their output all-gathered
    tp_reduce_rules.py    a mean/sum over the sharded dim: a partial sum, all-reduced over tp (q/k norms)
    tp_pullback_rules.py  a shard pulled back through elementwise ops and table lookups (position tables)
    tp_inplace_rules.py   a tensor allocated and filled in place (new_empty + copy_ into slices)
    tp_coverage.py        say what stays replicated because no rule covers it

Rewriting::

    tensor_parallel.py    shard the regions' weights, insert Megatron's f and g
    vocab_parallel.py     embedding, LM head and loss on vocabulary shards
    sequence_parallel.py  the replicated stretches between regions sharded on the sequence
    tp_random.py          random ops on shards draw from the tp rank's own stream

Reading a rewritten graph::

    collective_audit.py   every collective a rewritten graph does, with its bytes
"""
