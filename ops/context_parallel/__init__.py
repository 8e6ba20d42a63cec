"""Context parallelism's ops (installed as ``autopar.ops.context_parallel``): the sequence cut over cp.

Phase 1 (issue 36): the ops and the layout stand alone and are tested against one device; no pass inserts
them into a graph yet and no program builds a cp group (docs/context_parallel.md lists what the
integration adds).

    layout.py             CpLayout: the load-balanced (or contiguous) cut, positions, shard/join, batch helpers
    block_math.py         one block of attention in fp32: visibility, scores, online-softmax merge, gradients
    ring.py               RingAttention: K/V blocks around the cp ring, dK/dV back to their owners
    ulysses.py            UlyssesAttention: sequence shards to head shards and back (all-to-all)
"""
