"""Mixture of experts: MoE layers found, experts split over ep ranks and sharded over tp (``autopar.passes.moe``).

Passes::

    moe_detect.py         MoE layers found in the graph: router, top-k, experts, combine, aux loss
    moe_aux.py            the router's load-balancing statistics averaged over dp (aux loss as one device)
    moe_expert_parallel.py experts split over ep ranks, all-to-all dispatch and combine nodes
    tp_expert_rules.py    placement rules of grouped expert products (one table entry each)
    tp_expert.py          expert tensor parallelism: each expert's MLP column/row-sharded over tp
"""
