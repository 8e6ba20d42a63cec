"""Process-group rendezvous that survives torchrun's restarts.

When torchrun (``--max-restarts``) restarts a job whose workers share the agent's TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``, as with ``--rdzv-backend c10d``), the store still holds the
previous attempt's keys: gloo's full-mesh connect can read a dead worker's address and fail with
"Connection refused". :func:`restart_safe_rendezvous` gives ``init_process_group`` the same store
under a prefix of its own per attempt, so each attempt only sees its own addresses.
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["restart_safe_rendezvous"]


def restart_safe_rendezvous(*, timeout_s: float = 1800.0) -> dict:
    """Keyword arguments for ``dist.init_process_group``: empty unless running under a restarting
    torchrun agent's store, then ``store`` (prefixed by the attempt), ``rank`` and ``world_size``."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    prefix = f"/autopar/attempt_{env['TORCHELASTIC_RESTART_COUNT']}"
    return {"store": dist.PrefixStore(prefix, store), "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"])}
