"""Seeing a running job: memory, heartbeats, a failed job's diagnosis, stragglers (``autopar.runtime.diagnostics``).

Modules::

    memory_probe.py       bytes a rank holds, activations saved for backward
    flight_watch.py       heartbeats, and the job-wide diagnosis every surviving rank writes
    diagnosis.py          every rank's flight record read together: who stopped the job and why
    stragglers.py         a rank computing markedly slower than its peers on the same stages
"""
