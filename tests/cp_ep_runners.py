"""Runner kind for context parallelism with expert parallelism (``kind="cp_ep_runners:cp_ep_train"``).

:func:`cp_family_runners.cp_train` (a transformers family on dict batches, its own loss) with the replica record
keyed for expert parallelism, as ``moe_runners`` keys it: the ranks of one ep group hold other experts, so a rank's
replicas are the ranks with the same (pp, tp, dp mod ep), whatever their edp index and cp coordinate; the harness
(:func:`equivalence.judge_ranks`) then compares every rank bitwise with the first one holding its experts.
"""
from __future__ import annotations

import json

from cp_family_runners import cp_train


def cp_ep_train(case, mesh) -> dict:
    out = cp_train(case, mesh)
    ep = json.loads(out["plan"])["expert_parallel"]
    coords = dict(out["coords"])
    out["coords"] = {"dp": coords["dp"] // ep, "pp": coords["pp"], "tp": (coords["tp"], coords["dp"] % ep)}
    return out
