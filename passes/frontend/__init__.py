"""The lowering's front: the model captured into one ATen graph, the analyses reading it (``autopar.passes.frontend``).

Capture turns the model (and its loss) into one flat graph; the analyses write ``node.meta`` or refuse
what cannot run sharded, rewriting nothing. Every later pass reads what they wrote.

Capture::

    capture.py            nn.Module (+ loss) -> one flat ATen graph (torch.export, or symbolic_trace)
    capture_model.py      the capture pass: the model (bf16 copy, block template) captured into the state
    dynamic_capture.py    the sequence dim captured symbolic (torch.export's Dim.AUTO), the dims it found
    devices.py            devices baked into the graph retargeted (meta constants -> CPU)
    low_precision.py      precision="bf16": the bf16 copy of the model that capture traces
    block_template.py     identical blocks: capture a few, repeat the last one after sharding

Analyses and checks (node.meta, nothing rewritten)::

    shape_prop.py         shapes and dtypes, by running the graph on fake tensors
    annotate.py           shapes, FLOPs, bytes, module paths, parameter ownership
    index_bounds.py       which inputs index a table, and how far (the runtime's index guard reads it)
    seq_bounds.py         the longest sequence a symbolic graph takes (export's range, position tables, config)
    symbolic_sizes.py     size nodes recomputed per stage; edge shapes fit as SizeExprs of the symbols
    batch_stats.py        refuse batch statistics over part of the batch (BatchNorm, dp > 1)
    static_shapes.py      refuse data-dependent output shapes
    item_count.py         where the model's own loss counts its label tokens (num_items_in_batch)
    mean_loss.py          a loss_fn that is a token mean: each microbatch's loss weighed by its tokens
"""
