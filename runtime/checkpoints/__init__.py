"""Checkpoints that reshard: save on one mesh, load on another (installed as ``autopar.runtime.checkpoints``).

Modules::

    checkpoint_layout.py  layouts, pieces, split and join
    checkpoint_files.py   the folder per step, the latest pointer, the manifest, atomic publish
    rng_state.py          each rank's random state, restored or re-derived
    checkpoint.py         checkpoints that reshard: save on one mesh, load on another
    checkpoint_extra.py   what a checkpoint carries besides the model (a scheduler, any state_dict owner)
"""
