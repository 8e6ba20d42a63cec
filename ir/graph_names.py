"""Names in a captured graph, as the user's model spells them.

Capture (:mod:`autopar.passes.frontend.capture`) roots the model under ``MODEL_PREFIX``: a parameter the
user calls ``blocks.0.mlp.fc.weight`` is the graph attribute ``model.blocks.0.mlp.fc.weight``.
The compiler, the planner and the runtime all name parameters to the user through this one function.

Example::

    >>> user_name("model.blocks.0.mlp.fc.weight")
    'blocks.0.mlp.fc.weight'
    >>> user_name("labels")
    'labels'
"""
from __future__ import annotations

__all__ = ["MODEL_PREFIX", "user_name"]

MODEL_PREFIX = "model"  # the attribute capture's wrappers hold the user's model as (passes/frontend/capture.py)


def user_name(graph_name: str) -> str:
    """A graph attribute name (``model.blocks.0.mlp.fc.weight``) as the user's model names it."""
    prefix = MODEL_PREFIX + "."
    return graph_name[len(prefix):] if graph_name.startswith(prefix) else graph_name
