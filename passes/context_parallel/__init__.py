"""Context parallelism's analyses (installed as ``autopar.passes.context_parallel``): attention and the sequence.

Phase 1 (issue 36): analyses only, writing node meta; no pass rewrites a graph for cp yet
(docs/context_parallel.md lists what the integration adds).
"""
