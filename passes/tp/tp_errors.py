"""The tensor-parallel analyses' one signal: :class:`NoRule`, an op that cannot run on shards as placed.

Raised by the placement rules (:mod:`autopar.passes.tp.tp_rules`, :mod:`autopar.passes.moe.tp_expert_rules`)
and caught by the region solver, which leaves the candidate replicated and records the message.
"""
from __future__ import annotations

__all__ = ["NoRule"]


class NoRule(Exception):
    """The op cannot run on sharded inputs without communication (reason in the message)."""
