"""Each rank's flight record: a ring buffer of its last actions, collectives and transfers.

Every rank keeps one :class:`FlightRecord` of ``capacity`` fixed-size entries (64 bytes each):
the schedule's actions (``0F3``), each collective the runtime issues (its op, purpose, the global
ranks of its group and its *sequence number in that group*: the n-th collective this rank issued
over those ranks), each pipeline send and receive (peer, edge, microbatch), the step's start and
notes (a failure, a straggler). An entry has a start and an end time (``time.time()``) and a state:
``open`` (begun), ``waiting`` (this rank is blocked in it), ``done`` or ``failed``.

Writing one costs a ``struct.pack_into`` into a preallocated buffer (a microsecond or two): no
allocation that grows, no lock, no communication. With a ``folder`` (compile's ``run_dir``) the
buffer is a file mapped into memory, ``flight/rank<R>.bin`` (strings go once each to
``rank<R>.names``), so a rank killed by SIGKILL or aborted by gloo leaves its record behind: the
kernel keeps a shared mapping's pages when the process dies. :func:`read_record` reads it back;
:mod:`autopar.runtime.diagnostics.diagnosis` reads every rank's record together.

    >>> record = FlightRecord(rank=0, capacity=8)
    >>> a = record.begin(ACTION, "0F0", stage=0, microbatch=0)
    >>> c = record.collective("all_reduce", "the loss", (0, 1))
    >>> record.end(c); record.end(a)
    >>> [e.describe() for e in record.entries()]
    ['0F0 (stage 0, microbatch 0)', 'all_reduce #1 over ranks [0, 1] (the loss)']
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass

__all__ = ["FlightRecord", "Entry", "read_record", "record_files", "ACTION", "COLLECTIVE", "SEND", "RECV",
           "STEP", "NOTE", "KINDS", "STATES", "DEFAULT_CAPACITY"]

ACTION, COLLECTIVE, SEND, RECV, STEP, NOTE = range(6)
KINDS = ("action", "collective", "send", "recv", "step", "note")
OPEN, WAITING, DONE, FAILED = range(4)
STATES = ("open", "waiting", "done", "failed")
DEFAULT_CAPACITY = 4096

# index+1 (0: empty), kind, state, stage, microbatch, step, name, detail, group (string ids), peer, peer stage,
# seq (collective: number in its group; transfer: edge), start, end
_SLOT = struct.Struct("<QBBhiiiiiiiqdd")
_SIZE = _SLOT.size  # 64
_INDEX, _STATE_AT, _END_AT = struct.Struct("<Q"), 9, 56
_END = struct.Struct("<d")
_MAGIC = b"AUTOPAR-FLIGHT-1\n"
_HEADER = 4096  # bytes before the slots in a file: the magic, then the record's meta as JSON


@dataclass(frozen=True)
class Entry:
    """One decoded entry of a flight record."""

    index: int  # the rank's n-th entry
    kind: str  # one of KINDS
    state: str  # one of STATES
    stage: int
    microbatch: int
    step: int
    name: str  # the action ("0F3"), the collective's op, "activation"/"gradient", the note's label
    detail: str  # a collective's purpose, a note's text
    group: tuple[int, ...]  # a collective's global ranks
    peer: int  # a transfer's peer rank
    peer_stage: int
    seq: int  # a collective's number in its group; a transfer's edge
    start: float
    end: float  # 0.0 while not ended

    @property
    def is_open(self) -> bool:
        return self.state in ("open", "waiting")

    def signature(self) -> tuple[str, str]:
        """What must match across the ranks of a group at the same sequence number."""
        return self.name, self.detail

    def describe(self) -> str:
        """The entry in words (without its times)."""
        if self.kind == "action":
            return f"{self.name} (stage {self.stage}, microbatch {self.microbatch})"
        if self.kind == "collective":
            return f"{self.name} #{self.seq} over ranks {list(self.group)} ({self.detail})"
        if self.kind in ("send", "recv"):
            verb, way = ("send", "to") if self.kind == "send" else ("receive", "from")
            return (f"{verb} of the {self.name} of edge {self.seq}, microbatch {self.microbatch} {way} rank "
                    f"{self.peer} (stage {self.peer_stage})")
        if self.kind == "step":
            return f"training step {self.step}"
        return f"{self.name}: {self.detail}"


def record_files(folder: str, rank: int) -> tuple[str, str]:
    """The flight files of ``rank`` under ``folder`` (compile's ``run_dir``): the slots and the strings."""
    base = os.path.join(folder, "flight", f"rank{rank}")
    return base + ".bin", base + ".names"


class FlightRecord:
    """This rank's ring buffer of its last ``capacity`` entries (module docstring)."""

    def __init__(self, *, rank: int, capacity: int = DEFAULT_CAPACITY, folder: str | None = None,
                 meta: dict | None = None):
        self.rank, self.capacity = rank, max(int(capacity), 1)
        self.step = -1  # the training step the entries belong to (the program sets it)
        self.comm_wait_s = 0.0  # seconds this rank spent blocked in collectives (the executor reads it per action)
        self.longest_wait = (0.0, -1)  # (seconds, entry index) of the longest wait since the straggler check reset it
        self.meta = {"rank": rank, "capacity": self.capacity, "pid": os.getpid(), **(meta or {})}
        self.path = None
        self._next = 0
        self._ids: dict[str, int] = {"": 0}
        self._names: list[str] = [""]
        self._seq: dict[str, int] = {}
        self._names_file = None
        self._offset = 0
        if folder is None:
            self._buffer = bytearray(self.capacity * _SIZE)
        else:
            self._open_files(folder)

    def _open_files(self, folder: str) -> None:
        """New files (an earlier record of this rank, still mapped by a live program, keeps its own)."""
        self.path, names = record_files(folder, self.rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        size = _HEADER + self.capacity * _SIZE
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w+b") as f:
            f.truncate(size)
            self._buffer = mmap.mmap(f.fileno(), size)
        self._offset = _HEADER
        self.set_meta()
        self._names_file = open(f"{names}.{os.getpid()}.tmp", "w", encoding="utf-8")  # noqa: SIM115 - kept open
        self._names_file.write(json.dumps("") + "\n")
        self._names_file.flush()
        os.replace(self._names_file.name, names)
        os.replace(tmp, self.path)

    def set_meta(self, **meta) -> None:
        """Add to the record's meta (coordinates, stages, world size), kept in the file's header."""
        self.meta.update(meta)
        if self.path is not None:
            head = _MAGIC + json.dumps(self.meta).encode()
            if len(head) < _HEADER:
                self._buffer[:_HEADER] = head.ljust(_HEADER, b" ")

    def _id(self, text: str) -> int:
        found = self._ids.get(text)
        if found is None:
            found = self._ids[text] = len(self._names)
            self._names.append(text)
            if self._names_file is not None:  # on disk before any slot names it
                self._names_file.write(json.dumps(text) + "\n")
                self._names_file.flush()
        return found

    # -- writing (the hot path) ----------------------------------------------------------------
    def begin(self, kind: int, name: str, *, stage: int = -1, microbatch: int = -1, detail: str = "",
              group: str = "", peer: int = -1, peer_stage: int = -1, seq: int = -1, state: int = OPEN) -> int:
        """Write a new entry (overwriting the oldest once full); returns its index for :meth:`end`."""
        index = self._next
        self._next = index + 1
        _SLOT.pack_into(self._buffer, self._offset + (index % self.capacity) * _SIZE, index + 1, kind, state,
                        stage, microbatch, self.step, self._id(name), self._id(detail), self._id(group), peer,
                        peer_stage, seq, time.time(), 0.0)
        return index

    def _slot(self, index: int) -> int | None:
        """The byte offset of entry ``index``, or None once a newer entry has taken its slot."""
        at = self._offset + (index % self.capacity) * _SIZE
        return at if _INDEX.unpack_from(self._buffer, at)[0] == index + 1 else None

    def end(self, index: int, *, failed: bool = False) -> None:
        """Entry ``index`` has ended (or failed) now."""
        at = self._slot(index)
        if at is not None:
            _END.pack_into(self._buffer, at + _END_AT, time.time())
            self._buffer[at + _STATE_AT] = FAILED if failed else DONE

    def waiting(self, index: int) -> None:
        """This rank now blocks in entry ``index`` (a collective's or a receive's wait)."""
        at = self._slot(index)
        if at is not None:
            self._buffer[at + _STATE_AT] = WAITING

    def collective(self, op: str, purpose: str, ranks: tuple[int, ...], *, state: int = OPEN) -> int:
        """Begin a collective over the global ``ranks``, numbered in that group."""
        group = ",".join(map(str, ranks))
        seq = self._seq.get(group, 0) + 1
        self._seq[group] = seq
        return self.begin(COLLECTIVE, op, detail=purpose, group=group, seq=seq, state=state)

    def note(self, label: str, text: str, *, failed: bool = False) -> None:
        """A one-off entry: a failure, a straggler warning (its text cut at 400 characters)."""
        self.end(self.begin(NOTE, label, detail=text if len(text) <= 400 else text[:397] + "..."), failed=failed)

    def close(self) -> None:
        """Stop writing to the files (the record stays readable in memory)."""
        if self._names_file is not None:
            self._names_file.close()
            self._names_file = None

    # -- reading ---------------------------------------------------------------------------------
    def snapshot(self, last: int | None = None) -> dict:
        """The record (its ``last`` entries only, if given) as JSON-able data: the raw slots and the strings;
        :func:`decode` reads it."""
        raw = bytes(self._buffer[self._offset:self._offset + self.capacity * _SIZE])  # one copy, under the GIL
        slots = _raw_slots(raw)
        return {"meta": dict(self.meta), "names": list(self._names), "slots": slots[-last:] if last else slots}

    def entries(self) -> list[Entry]:
        """Every entry still held, oldest first."""
        return decode(self.snapshot())

    def latest(self, n: int) -> list[Entry]:
        """The newest ``n`` entries, oldest first (cheap: only their slots are read)."""
        first = max(self._next - min(n, self.capacity), 0)
        slots = [_SLOT.unpack_from(self._buffer, self._offset + (i % self.capacity) * _SIZE)
                 for i in range(first, self._next)]
        return decode({"names": list(self._names), "slots": [s for s in slots if s[0]]})

    @property
    def num_written(self) -> int:
        """Entries written so far (the ones held are the last ``capacity``)."""
        return self._next


def _raw_slots(raw: bytes) -> list[tuple]:
    slots = [s for s in _SLOT.iter_unpack(raw) if s[0]]
    return sorted(slots)


def decode(snapshot: dict) -> list[Entry]:
    """The entries of a :meth:`FlightRecord.snapshot` (or a file's), oldest first."""
    names = snapshot["names"]

    def text(i: int) -> str:
        return names[i] if 0 <= i < len(names) else "?"

    out = []
    for (index, kind, state, stage, mb, step, name, detail, group, peer, peer_stage, seq, start,
         end) in snapshot["slots"]:
        ranks = tuple(int(r) for r in text(group).split(",")) if text(group) else ()
        out.append(Entry(index - 1, KINDS[kind], STATES[state], stage, mb, step, text(name), text(detail), ranks,
                         peer, peer_stage, seq, start, end))
    return out


def read_record(folder: str, rank: int) -> dict | None:
    """Rank ``rank``'s flight file under ``folder`` as a snapshot (``decode`` reads it), or None if absent."""
    path, names_path = record_files(folder, rank)
    if not (os.path.exists(path) and os.path.exists(names_path)):
        return None
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_MAGIC):
        return None
    meta = json.loads(data[len(_MAGIC):_HEADER].decode().strip() or "{}")
    with open(names_path, encoding="utf-8") as f:
        names = [json.loads(line) for line in f if line.strip()]
    return {"meta": meta, "names": names, "slots": _raw_slots(data[_HEADER:_HEADER + meta["capacity"] * _SIZE])}
