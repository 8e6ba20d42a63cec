"""Data parallelism's graph rewrite: ZeRO-3's gathers and frees (installed as ``autopar.passes.data_parallel``).

The other ZeRO stages change no graph: the runtime shards optimizer state and gradients
(``autopar.runtime.state``).

Passes::

    zero3.py              ZeRO-3: gather each group of dp shards before use, free after
"""
