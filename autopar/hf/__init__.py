"""Hugging Face checkpoints in and out of a compiled program.

    program = autopar.compile(model, mesh, ...)
    autopar.hf.load_pretrained(program, "path/to/llama")      # every rank reads only its own pieces
    ...train...
    autopar.hf.save_pretrained(program, "path/to/trained")    # rank 0 writes; from_pretrained loads it

Both are collective: every rank of the job calls them. docs/hf.md describes the file layout,
the name mapping and what is refused. Needs ``safetensors`` (``pip install 'autopar[models]'``).
"""
from autopar.hf.load import LoadReport, load_pretrained
from autopar.hf.save import save_pretrained

__all__ = ["load_pretrained", "save_pretrained", "LoadReport"]
