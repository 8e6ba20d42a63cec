"""The job-wide diagnosis: every rank's flight record read together, and who stopped the job and why.

:func:`diagnose` takes what is known of each rank (a :class:`RankView`: its flight record, published
on the rendezvous store by a live rank or read from the flight file a dead one left, and how long
ago its last heartbeat was) and returns a :class:`Diagnosis`:

- **waits**: each rank blocked in a collective or a receive (or that gave up on one), and the ranks
  it waits on: for a receive, its peer; for a collective, the members of the group that have not
  issued that collective's sequence number yet (or are gone);
- **the first divergence**: the first sequence number of a group at which its ranks issued
  different collectives (op and purpose). Where one rank's sequence continues the others' one
  collective later, it *skipped* one; where a majority agrees, the others issued another one;
- **the culprit**: the rank that skipped or diverged; else the rank the waits lead to that is not
  waiting itself (gone: no heartbeat; computing in an action since long; outside any collective);
  else, in a cycle of pipeline receives, the rank that ran the action producing the awaited
  value without sending it.

:meth:`Diagnosis.text` is the report every surviving rank logs and writes to ``run_dir``
(``diagnosis.txt``; ``diagnosis.json`` holds the views, and ``autopar diagnose RUN_DIR`` rebuilds
the same text from it, or from the flight files alone when no rank lived to write a report).
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from autopar.ops.flight_record import Entry, decode, read_record

__all__ = ["RankView", "Wait", "Divergence", "Culprit", "Diagnosis", "diagnose", "views_to_json",
           "views_from_json", "read_run"]

_COMPARE = 8  # collectives compared after a divergence to tell a skip from another collective
_SHOWN = 6  # entries of each rank the report lists
_FILE = re.compile(r"^rank(\d+)\.bin$")


@dataclass
class RankView:
    """What is known of one rank: its record (``snapshot``: FlightRecord.snapshot's data, or None) and liveness."""

    rank: int
    snapshot: dict | None = None
    source: str = "none"  # "store": published by the live rank; "file": read from its flight file; "none"
    heartbeat_age: float | None = None  # seconds since its last heartbeat when the report was made; None: unknown
    heartbeat_doing: str = ""  # what its last heartbeat said it was doing
    alive: bool | None = None  # False: no heartbeat and nothing published; None: unknown (read afterwards)
    failure: str = ""  # what this rank raised, when it published after a failure
    entries: list[Entry] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self.entries = decode(self.snapshot) if self.snapshot else []

    @property
    def meta(self) -> dict:
        return (self.snapshot or {}).get("meta", {})


@dataclass(frozen=True)
class Wait:
    """Rank ``rank`` blocks (or gave up) in ``entry``, waiting on ``on``."""

    rank: int
    entry: Entry
    on: tuple[int, ...]
    during: str
    gone: bool = False  # the waiting rank is gone itself: its record stops in this wait


@dataclass(frozen=True)
class Divergence:
    """At collective ``seq`` of ``group`` the ranks issued different collectives."""

    group: tuple[int, ...]
    seq: int
    issued: dict  # rank -> Entry at seq
    during: dict  # rank -> the action it ran then
    culprits: dict  # rank -> "skipped" | "issued another collective"


@dataclass(frozen=True)
class Culprit:
    rank: int
    why: str


@dataclass
class Diagnosis:
    """The report's content (module docstring); :meth:`text` writes it out."""

    world: int
    now: float
    reporter: int
    reason: str
    views: dict
    waits: list
    divergence: Divergence | None
    culprit: Culprit | None

    def text(self) -> str:
        return "\n".join(_report_lines(self))

    def summary(self) -> str:
        """One line: the culprit, its last action and what the others wait on."""
        if self.culprit is None:
            return "no single culprit found: " + ("; ".join(_wait_line(w, self.now) for w in self.waits[:2])
                                                  or "no rank waits on another")
        waits = [w for w in self.waits if self.culprit.rank in w.on] or self.waits
        line = f"culprit rank {self.culprit.rank}: {self.culprit.why}; its last action: " \
               f"{_last_action(self.views.get(self.culprit.rank), self.now)}"
        return line + (f"; {_wait_line(waits[0], self.now)}" if waits else "")


# -- one rank's state --------------------------------------------------------------------------------
def _current(view: RankView) -> list[Entry]:
    """The entries of the rank's latest step (all of them before its first step marker)."""
    entries = view.entries
    starts = [i for i, e in enumerate(entries) if e.kind == "step"]
    return entries[starts[-1]:] if starts else entries


def _wait_of(view: RankView) -> Entry | None:
    """The collective or receive the rank blocks in or gave up on, in its latest step."""
    for e in reversed(_current(view)):
        if e.kind in ("collective", "recv") and e.state in ("waiting", "failed"):
            return e
    return None


def _last(view: RankView | None, kind: str) -> Entry | None:
    return next((e for e in reversed(view.entries) if e.kind == kind), None) if view else None


def _during(view: RankView, entry: Entry) -> str:
    """The action the rank ran when ``entry`` began, or where it was outside the schedule."""
    for e in reversed(view.entries):
        if e.index < entry.index and e.kind == "action":
            if e.end == 0.0 or e.end >= entry.start:
                return e.name
            break
    return f"step {entry.step}, outside the schedule's actions"


def _last_action(view: RankView | None, now: float) -> str:
    action = _last(view, "action")
    if action is None:
        return f"unknown (its last heartbeat said: {view.heartbeat_doing})" if view and view.heartbeat_doing \
            else "unknown"
    if action.is_open and view.alive is False:
        return f"{action.describe()}, step {action.step}, begun {now - action.start:.1f} s before this report " \
               f"and not ended when its record stops"
    if action.is_open:
        return f"{action.describe()}, step {action.step}, running for {now - action.start:.1f} s"
    return f"{action.describe()}, step {action.step}, ended {now - action.end:.1f} s before this report"


def _arrived(view: RankView, group: tuple[int, ...]) -> int:
    """The highest sequence number the rank issued in ``group`` (0: none held)."""
    return max((e.seq for e in view.entries if e.kind == "collective" and e.group == group), default=0)


def _same(view: RankView | None, entry: Entry) -> bool:
    """Whether the rank of ``view`` issued ``entry``'s collective (same group, number, op and purpose) in time:
    before ``entry``'s rank gave up on it."""
    if not _known(view) or _arrived(view, entry.group) < entry.seq:
        return False
    theirs = next((e for e in view.entries if e.kind == "collective" and e.group == entry.group
                   and e.seq == entry.seq), None)
    if theirs is None:  # out of its ring buffer
        return True
    late = entry.state == "failed" and theirs.start > entry.end
    return theirs.signature() == entry.signature() and not late


def _known(view: RankView | None) -> bool:
    return view is not None and bool(view.entries)


def _waits(views: dict) -> list[Wait]:
    out = []
    for rank, view in sorted(views.items()):
        entry = _wait_of(view)
        if entry is None:
            continue
        on = (entry.peer,) if entry.kind == "recv" else tuple(
            r for r in entry.group if r != rank and not _same(views.get(r), entry))
        out.append(Wait(rank, entry, on, _during(view, entry), gone=view.alive is False))
    return out


# -- the first divergence ----------------------------------------------------------------------------
def _by_group(views: dict) -> dict:
    groups: dict = {}
    for rank, view in views.items():
        for e in view.entries:
            if e.kind == "collective":
                groups.setdefault(e.group, {}).setdefault(rank, {})[e.seq] = e
    return groups


def _sigs(seqs: dict, start: int) -> list:
    return [seqs[s].signature() for s in range(start, start + _COMPARE) if s in seqs]


def _skipped(mine: list, theirs: list) -> bool:
    """Whether ``mine`` is ``theirs`` with its first collective left out."""
    pairs = list(zip(mine, theirs[1:]))
    return bool(pairs) and all(a == b for a, b in pairs)


def _blame(per_rank: dict, seq: int) -> dict:
    """{rank: what it did} for the ranks that left the others' sequence at ``seq``."""
    at = {r: seqs[seq].signature() for r, seqs in per_rank.items()}
    counts = Counter(at.values())
    top, n = counts.most_common(1)[0]
    majority = n > 1 and list(counts.values()).count(n) == 1
    sigs = {r: _sigs(seqs, seq) for r, seqs in per_rank.items()}
    out = {}
    for rank in per_rank:
        others = [o for o in per_rank if o != rank and (not majority or at[o] == top)]
        if majority and at[rank] == top:
            continue
        if any(_skipped(sigs[rank], sigs[o]) for o in others):
            out[rank] = "skipped"
        elif majority:
            out[rank] = "issued another collective"
    return out


def _divergence(views: dict) -> Divergence | None:
    found = []
    for group, per_rank in _by_group(views).items():
        if len(per_rank) < 2:
            continue
        common = set.intersection(*(set(seqs) for seqs in per_rank.values()))
        for seq in sorted(common):
            if len({seqs[seq].signature() for seqs in per_rank.values()}) > 1:
                issued = {r: seqs[seq] for r, seqs in per_rank.items()}
                found.append(Divergence(group, seq, issued, {r: _during(views[r], e) for r, e in issued.items()},
                                        _blame(per_rank, seq)))
                break
    return min(found, key=lambda d: min(e.start for e in d.issued.values()), default=None)


# -- the culprit ---------------------------------------------------------------------------------------
def _terminal(rank: int, views: dict, now: float) -> str | None:
    """Why ``rank`` is where the waits end, or None if it waits itself."""
    view = views.get(rank)
    if view is None or view.alive is False:
        age = f"no heartbeat for {view.heartbeat_age:.1f} s" if view and view.heartbeat_age is not None \
            else "no heartbeat"
        source = "; its record was read from its flight file" if view and view.source == "file" else ""
        return f"it is gone ({age}){source}"
    if not view.entries:
        return "it published no flight record"
    if _wait_of(view) is not None:
        return None
    action = _last(view, "action")
    if action is not None and action.is_open:
        return f"it waits on no peer: it has been running {action.describe()} for {now - action.start:.1f} s"
    last = view.entries[-1]
    return f"it is in no collective and no transfer: its last entry, {last.describe()}, " \
           f"{'began' if last.is_open else 'ended'} {now - (last.start if last.is_open else last.end):.1f} s ago"


def _unsent(wait: Wait, views: dict) -> Culprit | None:
    """In a cycle of receives: the peer that ran the producing action without sending what ``wait`` waits for."""
    e, peer = wait.entry, views.get(wait.entry.peer)
    if e.kind != "recv" or not _known(peer):
        return None
    if any(s.kind == "send" and s.peer == wait.rank and s.seq == e.seq and s.microbatch == e.microbatch
           and s.name == e.name and s.step == e.step for s in peer.entries):
        return None
    producer = f"{e.peer_stage}{'F' if e.name == 'activation' else 'B'}{e.microbatch}"
    if any(a.kind == "action" and a.name == producer and a.step == e.step for a in peer.entries):
        return Culprit(e.peer, f"it ran {producer} (step {e.step}) but never sent the {e.name} of edge {e.seq}, "
                               f"microbatch {e.microbatch} that rank {wait.rank} waits for")
    return None


def _diverged(dv: Divergence) -> Culprit:
    """The culprit of a divergence: the first rank that skipped a collective or issued another one."""
    rank, what = sorted(dv.culprits.items())[0]
    other = min((r for r in dv.issued if r not in dv.culprits), default=None)
    mine = dv.issued[rank]
    if other is None:
        return Culprit(rank, f"it issued {mine.name} ({mine.detail}) as #{dv.seq} over ranks {list(dv.group)}, "
                             f"unlike the others")
    ref, during = dv.issued[other], dv.during[other]
    if what == "skipped":
        return Culprit(rank, f"it skipped {ref.name} ({ref.detail}), which rank {other} issued as #{dv.seq} over "
                             f"ranks {list(dv.group)} during {during}; rank {rank}'s #{dv.seq} is {mine.name} "
                             f"({mine.detail})")
    return Culprit(rank, f"as #{dv.seq} over ranks {list(dv.group)} it issued {mine.name} ({mine.detail}) during "
                         f"{dv.during[rank]}, where rank {other} issued {ref.name} ({ref.detail}) during {during}")


def _late(waits: list, views: dict) -> Culprit | None:
    """A rank that issued a collective only after a peer had given up waiting in it (it was that slow)."""
    found = []
    for w in waits:
        e = w.entry
        if e.kind != "collective" or e.state != "failed":
            continue
        for rank in e.group:
            theirs = next((x for x in views[rank].entries if x.kind == "collective" and x.group == e.group
                           and x.seq == e.seq and x.signature() == e.signature()), None) if rank != w.rank else None
            if theirs is not None and theirs.start > e.end:
                found.append((theirs.start - e.start, rank, w, theirs))
    if not found:
        return None
    late, rank, w, theirs = max(found, key=lambda f: f[0])
    return Culprit(rank, f"it issued {theirs.describe()} {late:.1f} s after rank {w.rank} had begun waiting in it "
                         f"(rank {w.rank} gave up after {w.entry.end - w.entry.start:.1f} s); it was running "
                         f"{_during(views[rank], theirs)} until then")


def _culprit(waits: list, divergence: Divergence | None, views: dict, now: float) -> Culprit | None:
    if divergence is not None and divergence.culprits:
        return _diverged(divergence)
    late = _late(waits, views)
    if late is not None:
        return late
    reached: Counter = Counter()
    why: dict[int, str] = {}
    edges = {w.rank: w.on for w in waits}
    for w in waits:
        seen, todo = {w.rank}, list(w.on)
        while todo:
            rank = todo.pop()
            if rank in seen:
                continue
            seen.add(rank)
            reason = _terminal(rank, views, now)
            if reason is not None:
                reached[rank] += 1
                why[rank] = reason
            else:
                todo.extend(edges.get(rank, ()))
    if reached:
        rank = min(reached, key=lambda r: (-reached[r], r))
        return Culprit(rank, why[rank])
    return next((c for c in map(lambda w: _unsent(w, views), waits) if c is not None), None)


def diagnose(views: dict, *, world: int, now: float, reporter: int, reason: str) -> Diagnosis:
    """The diagnosis of the ranks in ``views`` ({rank: RankView}, every rank of the world ideally) at ``now``."""
    views = {r: views.get(r, RankView(r)) for r in range(world)}
    waits = _waits(views)
    divergence = _divergence(views)
    return Diagnosis(world=world, now=now, reporter=reporter, reason=reason, views=views, waits=waits,
                     divergence=divergence, culprit=_culprit(waits, divergence, views, now))


# -- the report's text -----------------------------------------------------------------------------------
def _wait_line(w: Wait, now: float) -> str:
    e = w.entry
    if e.state == "failed":
        how = f"gave up waiting in {e.describe()} after {e.end - e.start:.1f} s"
    elif w.gone:
        how = f"was waiting in {e.describe()} when its record stops ({now - e.start:.1f} s before this report)"
    else:
        how = f"waits in {e.describe()} since {now - e.start:.1f} s"
    on = f", waiting on rank{'s' if len(w.on) > 1 else ''} {', '.join(map(str, w.on))}" if w.on else \
        ", every other rank of it has issued it too"
    return f"rank {w.rank} {how}, during {w.during}{on}"


def _where(view: RankView) -> str:
    meta = view.meta
    coords = meta.get("coords")
    place = ", ".join(f"{k} {v}" for k, v in coords.items()) if coords else ""
    stages = meta.get("stages")
    return place + (f"; stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}" if stages else "")


def _rank_line(view: RankView, now: float) -> str:
    where = _where(view)
    head = f"rank {view.rank}" + (f" ({where})" if where else "")
    if view.alive is False:
        status = "gone: " + ("no heartbeat" if view.heartbeat_age is None else
                             f"no heartbeat for {view.heartbeat_age:.1f} s")
        if view.heartbeat_doing:
            status += f" (its last heartbeat: {view.heartbeat_doing})"
        if view.source == "file":
            status += "; record read from its flight file"
    elif view.source == "none":
        status = "no record" + (f"; last heartbeat {view.heartbeat_age:.1f} s ago" if view.heartbeat_age is not None
                                else "")
    else:
        status = {"store": "published its record", "file": "record read from its flight file"}[view.source]
    line = f"{head}: {status}; last action {_last_action(view, now)}"
    notes = [e for e in view.entries if e.kind == "note" and e.name == "straggler"]
    if notes:
        line += f"; flagged as a straggler at step {notes[-1].step}: {notes[-1].detail}"
    return line


def _report_lines(d: Diagnosis) -> list[str]:
    by = f"written by rank {d.reporter}" if d.reporter >= 0 else "rebuilt by autopar diagnose"
    lines = [f"autopar job diagnosis: {d.world} ranks, {by}", f"  why: {d.reason}"]
    if d.culprit is not None:
        lines += [f"culprit: rank {d.culprit.rank}: {d.culprit.why}",
                  f"  its last action: {_last_action(d.views.get(d.culprit.rank), d.now)}"]
    else:
        lines.append("culprit: none found (see the waits and the ranks below)")
    lines.append("waiting:" if d.waits else "waiting: no rank blocks in a collective or a receive")
    lines += [f"  {_wait_line(w, d.now)}" for w in d.waits]
    if d.divergence is not None:
        dv = d.divergence
        lines.append(f"first divergence: collective #{dv.seq} over ranks {list(dv.group)}")
        lines += [f"  rank {r}: {e.name} ({e.detail}) during {dv.during[r]}"
                  + (f"  <- {dv.culprits[r]}" if r in dv.culprits else "") for r, e in sorted(dv.issued.items())]
    lines.append("ranks:")
    lines += [f"  {_rank_line(v, d.now)}" for _, v in sorted(d.views.items())]
    lines.append("last entries of each rank (newest last; times before this report):")
    for rank, view in sorted(d.views.items()):
        for e in view.entries[-_SHOWN:]:
            t = f"-{d.now - e.start:.2f} s" + ("" if e.is_open else f" .. -{d.now - (e.end or e.start):.2f} s")
            lines.append(f"  rank {rank} step {e.step} {e.state:<7} {t:>22}  {e.kind} {e.describe()}")
    return lines


# -- persistence -------------------------------------------------------------------------------------------
def read_run(run_dir: str) -> Diagnosis | None:
    """The diagnosis of ``run_dir``: the one a rank wrote (``diagnosis.json``), else one rebuilt from the
    flight files alone (no liveness known; the ranks' last entries tell where each stopped); None if neither."""
    path = os.path.join(run_dir, "diagnosis.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return views_from_json(f.read())
    folder = os.path.join(run_dir, "flight")
    ranks = sorted(int(m.group(1)) for m in map(_FILE.match, os.listdir(folder) if os.path.isdir(folder) else ())
                   if m)
    snapshots = {r: read_record(run_dir, r) for r in ranks}
    snapshots = {r: s for r, s in snapshots.items() if s is not None}
    if not snapshots:
        return None
    world = max(max(s["meta"].get("world", 0) for s in snapshots.values()), max(snapshots) + 1)
    views = {r: RankView(r, s, source="file") for r, s in snapshots.items()}
    now = max((max(e.start, e.end) for v in views.values() for e in v.entries), default=0.0)
    return diagnose(views, world=world, now=now, reporter=-1,
                    reason=f"rebuilt from the flight files in {run_dir} (no rank wrote a report); times are "
                           f"counted back from the last entry of any rank")
def views_to_json(d: Diagnosis) -> str:
    """The diagnosis's inputs as JSON: ``views_from_json`` and :func:`diagnose` rebuild the same report."""
    views = [{"rank": v.rank, "snapshot": v.snapshot, "source": v.source, "heartbeat_age": v.heartbeat_age,
              "heartbeat_doing": v.heartbeat_doing, "alive": v.alive, "failure": v.failure}
             for _, v in sorted(d.views.items())]
    return json.dumps({"version": 1, "world": d.world, "now": d.now, "reporter": d.reporter, "reason": d.reason,
                       "views": views})


def views_from_json(text: str) -> Diagnosis:
    """The :class:`Diagnosis` of a ``diagnosis.json`` (:func:`views_to_json`)."""
    data = json.loads(text)
    views = {v["rank"]: RankView(**v) for v in data["views"]}
    return diagnose(views, world=data["world"], now=data["now"], reporter=data["reporter"], reason=data["reason"])
