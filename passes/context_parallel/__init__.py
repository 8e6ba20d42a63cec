"""Context parallelism's analyses (installed as ``autopar.passes.context_parallel``): attention and the sequence.

Phase 1 (issue 36): analyses only, writing node meta; no pass rewrites a graph for cp yet and the
lowering runs none of them (docs/context_parallel.md lists what the integration adds).

    graph_util.py         small readers of a captured ATen graph (op keys, shapes, ancestors, parameters)
    mask_probe.py         an attention's mask and bias terms evaluated on probes: causal, window, padding, documents, ALiBi
    attention.py          every attention of a graph (SDPA and eager): operands, layouts, heads, scale, masks
    seq_place.py          Place: where a value holds the sequence, followed through views
    seq_rules.py          the sequence rules per op family, as data, and the refusals
    rowwise.py            a module proven to compute each position from that position alone (MoE layers)
    seq_dims.py           the sequence analysis: every node's rule (autopar.seq) and the refusals with fixes
"""
