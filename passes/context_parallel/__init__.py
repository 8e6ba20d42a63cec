"""Context parallelism (installed as ``autopar.passes.context_parallel``): attention and the sequence found in the
graph, and the pass that cuts the sequence over the cp mesh dim (the lowering runs it when cp > 1; what is not
wired yet: docs/context_parallel.md).

    graph_util.py         small readers of a captured ATen graph (op keys, shapes, ancestors, parameters)
    mask_probe.py         an attention's mask and bias terms evaluated on probes: causal, window, padding, documents, ALiBi
    attention.py          every attention of a graph (SDPA and eager): operands, layouts, heads, scale, masks
    seq_place.py          Place: where a value holds the sequence, followed through views
    seq_rules.py          the sequence rules per op family, as data, and the refusals
    rowwise.py            a module proven to compute each position from that position alone (MoE layers)
    seq_dims.py           the sequence analysis: every node's rule (autopar.seq) and the refusals with fixes
    cp_shard.py           the transform: attention as ring or all-to-all nodes, global positions, local sizes
"""
