"""Hugging Face checkpoints in and out of a compiled program.

    program = autopar.compile(model, mesh, ...)
    autopar.hf.load_pretrained(program, "path/to/llama")      # every rank reads only its own pieces
    ...train...
    autopar.hf.save_pretrained(program, "path/to/trained")    # rank 0 writes; from_pretrained loads it

A model built on the meta device takes the folder at compile time instead, so no rank ever
allocates more than its own pieces::

    program = autopar.compile(meta_model, mesh, ..., weights=autopar.hf.pretrained_weights(folder, meta_model))

Both are collective: every rank of the job calls them. docs/hf.md describes the file layout,
the name mapping and what is refused. Needs ``safetensors`` (``pip install 'autopar[models]'``).
"""
from autopar.hf.filler import pretrained_weights
from autopar.hf.load import LoadReport, load_pretrained
from autopar.hf.save import save_pretrained

__all__ = ["load_pretrained", "pretrained_weights", "save_pretrained", "LoadReport"]
