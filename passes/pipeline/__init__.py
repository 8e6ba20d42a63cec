"""Pipeline parallelism: the graph becomes stage graphs (installed as ``autopar.passes.pipeline``).

Stage cuts, the split into one GraphModule per stage, and what a schedule asks of the stage graphs
(split backward, a second replica, recomputed regions).

Passes::

    partition.py          cost-balanced stage cuts at block boundaries
    pipeline_split.py     one GraphModule per stage, joined by visible send/recv nodes
    weight_grad_split.py  zero-bubble schedules: every weight use exposed for a split backward
    chimera_replicate.py  Chimera: a second replica of every stage, re-addressed
    recompute.py          checkpointed block regions (full / selective)
"""
