"""DualPipeV (DeepSeek-V3 report, 2024; "cut-in-half" DualPipe): two stages per rank in a V, F and B overlapped.

The model is cut into ``2p`` stages placed as in ZB-V: rank ``r`` runs stage ``r`` (its first
chunk, on the way down) and stage ``2p - 1 - r`` (its second chunk, on the way up), so rank
``p - 1`` turns the activations round without a transfer. What defines DualPipeV is its steady
phase: each step is a *pair*, the forward of one microbatch on one chunk and the full backward of
another on the other chunk, which the runtime may overlap (one's communication hidden under the
other's compute). Backward is split (B: input gradient, W: weight gradient) only where a W can fill
a gap: in the warmup's third phase and in the drain; elsewhere a "full" backward is written as B
immediately followed by its own W.

Each rank's list follows DeepSeek's eight phases (the ones torch.distributed.pipelining's
ScheduleDualPipeV builds), with ``p`` ranks, ``m >= 2p`` microbatches and ``c0``/``c1`` the
rank's two chunks (with fewer than ``2p`` microbatches, the order for ``2p`` is built and the
missing microbatches dropped, as :mod:`~autopar.runtime.schedules.zb_v` does; a pair that loses a
half is no longer a pair):

1. ``2(p - r - 1)`` forwards on c0 (fill the down leg);
2. ``r + 1`` pairs of forwards, c0 then c1;
3. ``p - r - 1`` times: B on c1, the oldest pending W, F on c1 (zero-bubble warmup);
4. ``m - 2p + r + 1`` times: the overlapped pairs (F c0, full B c1) and (F c1, full B c0); the last
   rank's very first pair is not overlapped (F c0 then full B c1), to shorten its bubble;
5. ``p - r - 1`` times: a full B on c1, then the pair (F c1, full B c0);
6. ``r + 1`` times: B on c1, then B on c0; from the middle of this phase on (one chunk earlier on
   odd ranks) backwards are split and their W's queued;
7. ``p - r - 1`` times: the oldest pending W, then B on c0 (split when phase 6 turned splitting on);
8. ``r + 1`` pending W's.

The overlapped pairs are part of the data: ``Schedule.overlapped[r]`` holds the index of each
pair's F in rank ``r``'s list (its B is the next action), and the grid and CSV print a pair as one
cell, ``0F5&3B1``. With ``m`` microbatches the step holds ``m`` forwards and backwards per stage,
like every other schedule here; the bubble is that of ZB-V's fill and drain.

    >>> from autopar.runtime.schedules.dualpipe import dualpipev
    >>> s = dualpipev(num_ranks=2, num_microbatches=4)
    >>> " ".join(str(a) for a in s.actions[1])
    '1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3'
    >>> s.overlapped[1]
    (7, 10, 13)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from autopar.runtime.schedules._common import B, F, W, check_count
from autopar.runtime.schedules.action import Action, Schedule
from autopar.runtime.schedules.chimera import chimera_placement
from autopar.errors import ScheduleError

__all__ = ["dualpipe", "dualpipev"]


def dualpipev(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """The DualPipeV schedule: ``2 * num_ranks`` stages in a V, overlapped F/B pairs, W's in the gaps."""
    p = check_count("dualpipev", "num_ranks", num_ranks)
    m = check_count("dualpipev", "num_microbatches", num_microbatches)
    rows, pairs = _kept([_RankOrder(rank, p).build(max(m, 2 * p)) for rank in range(p)], m)
    return Schedule(
        name="dualpipev", num_ranks=p, num_stages=2 * p, num_microbatches=m,
        stage_to_rank=tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)),
        actions=tuple(rows), split_backward=True, full_backward=True, overlapped=tuple(pairs),
    )


class _RankOrder:
    """Builds one rank's list; counters give each stage's next microbatch, ``pending`` the queued W's.

    ``rank`` and ``p`` are the position in DeepSeek's phase formulas (DualPipe passes the half
    rank and half the ranks), ``chunks`` the rank's two stages (nearest the input first) and
    ``microbatch(stage, k)`` the id of the ``k``-th microbatch through ``stage``.
    """

    def __init__(self, rank: int, p: int, *, chunks: tuple[int, int] | None = None,
                 microbatch: Callable[[int, int], int] = lambda stage, k: k):
        self.rank, self.p = rank, p
        self.chunks = chunks if chunks is not None else (rank, 2 * p - 1 - rank)
        self.microbatch = microbatch
        self.next_f = {s: 0 for s in self.chunks}
        self.next_b = {s: 0 for s in self.chunks}
        self.pending: deque[Action] = deque()
        self.row: list[Action] = []
        self.overlapped: list[int] = []

    def forward(self, chunk: int) -> None:
        stage = self.chunks[chunk]
        self.row.append(F(stage, self.microbatch(stage, self.next_f[stage])))
        self.next_f[stage] += 1

    def backward(self, chunk: int, *, split: bool) -> None:
        """B on ``chunk``; split: its W is queued for later, else it follows at once (a full backward)."""
        stage = self.chunks[chunk]
        microbatch = self.microbatch(stage, self.next_b[stage])
        self.next_b[stage] += 1
        self.row.append(B(stage, microbatch))
        if split:
            self.pending.append(W(stage, microbatch))
        else:
            self.row.append(W(stage, microbatch))

    def weight(self) -> None:
        if self.pending:
            self.row.append(self.pending.popleft())

    def pair(self, forward_chunk: int, backward_chunk: int) -> None:
        """The overlapped step: F on one chunk, then a full B on the other."""
        self.overlapped.append(len(self.row))
        self.forward(forward_chunk)
        self.backward(backward_chunk, split=False)

    def build(self, m: int) -> tuple[list[Action], list[int]]:
        r, p = self.rank, self.p
        for _ in range(2 * (p - r - 1)):  # 1: fill the down leg
            self.forward(0)
        for _ in range(r + 1):  # 2: forwards on both chunks
            self.forward(0)
            self.forward(1)
        for _ in range(p - r - 1):  # 3: zero-bubble warmup on the up leg
            self.backward(1, split=True)
            self.weight()
            self.forward(1)
        for i in range(m - 2 * p + r + 1):  # 4: the steady phase, two overlapped pairs per step
            if i == 0 and r == p - 1:  # the last rank's first pair runs apart (shorter bubble)
                self.forward(0)
                self.backward(1, split=False)
            else:
                self.pair(0, 1)
            self.pair(1, 0)
        for _ in range(p - r - 1):  # 5: the up leg drains first
            self.backward(1, split=False)
            self.pair(1, 0)
        split = False
        for i in range(r + 1):  # 6: both legs drain; the second half splits backward
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            self.backward(1, split=split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            self.backward(0, split=split)
        for _ in range(p - r - 1):  # 7: W's fill the down leg's drain
            self.weight()
            self.backward(0, split=split)
        while self.pending:  # 8: the W's left
            self.weight()
        assert all(self.next_f[s] == self.next_b[s] == m for s in self.chunks), (self.next_f, self.next_b)
        return self.row, self.overlapped


def dualpipe(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe: two model replicas in opposite directions (Chimera's placement), DualPipeV's phases per half.

    Rank ``r`` holds part ``r`` of the *down* replica (stage ``r``) and part ``p - 1 - r`` of the
    *up* one (stage ``2p - 1 - r``), as in :func:`~autopar.runtime.schedules.chimera.chimera`;
    microbatch ``i`` goes down when ``i`` is even and up when odd. Each rank runs the eight phases
    of :func:`dualpipev` with its *half rank* ``min(r, p - 1 - r)`` among ``p / 2`` and half of the
    microbatches per direction; its first chunk is the direction whose input end is nearer (down
    on the first half of the ranks, up on the second). The two replicas' gradients of each part
    are summed after the step, as for Chimera. ``p`` must be even (DeepSeek's condition);
    with fewer than ``2p`` microbatches the order for ``2p`` is built and the rest dropped.

        >>> s = dualpipe(num_ranks=2, num_microbatches=4)
        >>> " ".join(str(a) for a in s.actions[0])
        '0F0 3F1 0F2 3B1 3W1 3F3 0B0 0W0 3B3 3W3 0B2 0W2'
        >>> s.stage_to_rank, s.microbatch_replica, s.overlapped[0]
        ((0, 1, 1, 0), (0, 1, 0, 1), (5,))
    """
    p = check_count("dualpipe", "num_ranks", num_ranks)
    m = check_count("dualpipe", "num_microbatches", num_microbatches)
    if p % 2:
        raise ScheduleError(f"dualpipe needs an even number of pipeline ranks, got {p}",
                            where=f"schedule 'dualpipe', pp={p}",
                            fix="use an even pp, or 'dualpipev' (one replica, any pp), or 'chimera' for odd pp")
    half = p // 2
    per_direction = max(-(-m // 2), p)

    def microbatch(stage: int, k: int) -> int:  # the k-th microbatch of the stage's replica
        return 2 * k + (stage >= p)

    orders = []
    for rank in range(p):
        down, up = rank, 2 * p - 1 - rank
        chunks = (down, up) if rank < half else (up, down)
        orders.append(_RankOrder(min(rank, p - 1 - rank), half, chunks=chunks, microbatch=microbatch)
                      .build(per_direction))
    rows, pairs = _kept(orders, m)
    return Schedule(
        name="dualpipe", num_ranks=p, num_stages=2 * p, num_microbatches=m,
        stage_to_rank=chimera_placement(p), actions=tuple(rows), split_backward=True, full_backward=True,
        overlapped=tuple(pairs), num_replicas=2, microbatch_replica=tuple(i % 2 for i in range(m)),
    )


def _kept(orders: list[tuple[list[Action], list[int]]], m: int):
    """Each rank's order without the padding microbatches (ids >= m), pairs re-indexed; a broken pair is dropped."""
    rows, pairs = [], []
    for row, overlapped in orders:
        kept = [i for i, a in enumerate(row) if a.microbatch < m]
        index = {old: new for new, old in enumerate(kept)}
        rows.append(tuple(row[i] for i in kept))
        pairs.append(tuple(index[i] for i in overlapped if i in index and i + 1 in index))
    return rows, pairs
