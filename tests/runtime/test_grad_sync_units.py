"""The gradient synchronisation of a step (runtime/state/grad_sync.py) without a process group: torch.distributed
and the dp collectives are replaced by fakes that play the other ranks, so the arithmetic, the buckets
chosen, the order of the parts and their launch log are read in one process. The spawned equivalence cases
judge the same code over real groups."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from autopar.parallel_dims import ParallelDims
from autopar.plan_model import MeshShape
from autopar.runtime.execution.rank_context import MeshInfo, RankContext
from autopar.runtime.state import ddp_buckets, grad_sync
from autopar.runtime.state.grad_sync import GradientSync, average_gradients, flat_buckets, sum_shared_gradients


class _Done:
    def wait(self):
        return True


def _param(n: int, *, fill: float = 0.0, requires_grad: bool = True) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((n,), fill), requires_grad=requires_grad)


# -- flat_buckets -----------------------------------------------------------------------------------
def test_flat_buckets_fill_up_to_the_cap_in_order_and_split_at_a_dtype_change():
    a, b, c = torch.zeros(3), torch.zeros(3), torch.zeros(2)  # 12, 12, 8 bytes
    d, e = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    buckets = list(flat_buckets([a, b, c, d, e], bucket_bytes=24))
    assert [[id(t) for t in bucket] for bucket in buckets] == [[id(a), id(b)], [id(c)], [id(d), id(e)]]
    assert [len(bucket) for bucket in flat_buckets([a, b, c], bucket_bytes=23)] == [1, 2]  # 12 + 12 > 23, 12 + 8 not
    assert [len(bucket) for bucket in flat_buckets([c, c, c], bucket_bytes=16)] == [2, 1]
    assert list(flat_buckets([], bucket_bytes=24)) == []
    big = torch.zeros(10)  # a tensor over the cap gets a bucket of its own
    assert [len(bucket) for bucket in flat_buckets([big, a], bucket_bytes=24)] == [1, 1]
    assert [len(bucket) for bucket in flat_buckets([big, big, a])] == [3]  # 25 MiB by default


def test_a_new_bucket_starts_empty():
    """One-byte tensors: after a split the next bucket holds exactly the cap, and not a byte more."""
    def sizes(*numels):
        return [torch.zeros(n, dtype=torch.int8) for n in numels]
    assert [len(bucket) for bucket in flat_buckets(sizes(16, 8, 8, 9), bucket_bytes=16)] == [1, 2, 1]
    assert [len(bucket) for bucket in flat_buckets(sizes(16, 8, 9), bucket_bytes=16)] == [1, 1, 1]


def test_the_default_bucket_is_torch_ddps_25_mib():
    """Meta tensors (no memory): two halves of 25 MiB share a bucket, one more byte does not."""
    half = torch.empty(25 * 2**19, dtype=torch.int8, device="meta")
    byte = torch.empty(1, dtype=torch.int8, device="meta")
    assert [len(bucket) for bucket in flat_buckets([half, half, byte])] == [2, 1]


# -- average_gradients ------------------------------------------------------------------------------
def _fake_all_reduce(monkeypatch, peer: list[torch.Tensor], calls: list):
    """All-reduce over a dp of 2 whose other rank holds ``peer``'s tensors in order, one flat bucket at a time."""
    def issue(collective, fn, flat, *, group, guard, purpose):
        start = sum(c for c in calls)
        flat.add_(torch.cat([t.reshape(-1) for t in peer]).to(flat.dtype)[start: start + flat.numel()])
        calls.append(flat.numel())
        assert collective == "all_reduce" and fn is grad_sync.dist.all_reduce and group == "dp-group"
    monkeypatch.setattr(grad_sync, "issue", issue)


def test_average_gradients_is_the_mean_over_dp_with_a_missing_gradient_as_zero(monkeypatch):
    p, q, r = _param(3), _param(2), _param(4)
    p.grad, r.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 0.0, -2.0, 8.0])
    peer = [torch.tensor([3.0, 0.0, 5.0]), torch.tensor([6.0, -4.0]), torch.tensor([0.0, 2.0, 2.0, 0.0])]
    calls = []
    _fake_all_reduce(monkeypatch, peer, calls)
    average_gradients([p, q, r], group="dp-group", size=2)
    assert calls == [9]  # one bucket of every gradient
    torch.testing.assert_close(p.grad, torch.tensor([2.0, 1.0, 4.0]))
    torch.testing.assert_close(q.grad, torch.tensor([3.0, -2.0]))
    torch.testing.assert_close(r.grad, torch.tensor([2.0, 1.0, 0.0, 4.0]))


def test_average_gradients_over_one_rank_touches_nothing(monkeypatch):
    calls = []
    _fake_all_reduce(monkeypatch, [], calls)
    p = _param(2)
    average_gradients([p], group="dp-group", size=1)
    assert p.grad is None and calls == []


def test_average_gradients_writes_back_every_bucket_of_mixed_dtypes(monkeypatch):
    p, q = _param(2), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad, q.grad = torch.tensor([2.0, 4.0]), torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64)
    calls = []
    _fake_all_reduce(monkeypatch, [torch.tensor([0.0, 2.0]), torch.tensor([1.0, 1.0, 1.0])], calls)
    average_gradients([p, q], group="dp-group", size=2)
    assert calls == [2, 3]
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(q.grad, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


# -- sum_shared_gradients ---------------------------------------------------------------------------
class _FakeP2P:
    """torch.distributed's batched p2p over ranks whose gradients are ``held`` (global rank -> tensor)."""

    def __init__(self, held: dict[int, torch.Tensor]):
        self.held, self.sent = held, []

    def isend(self, *_):
        raise AssertionError("only batched")

    def irecv(self, *_):
        raise AssertionError("only batched")

    def P2POp(self, op, tensor, peer, group=None):  # noqa: N802 (torch's name)
        return SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group)

    def batch_isend_irecv(self, ops):
        for o in ops:
            assert o.group == "pp-group"
            if o.op == self.isend:
                self.sent.append((o.peer, o.tensor.clone()))
            else:
                o.tensor.copy_(self.held[o.peer])
        return [_Done() for _ in ops]


def test_a_tied_weight_gets_the_sum_of_every_copy_in_rank_order_bitwise_on_every_rank(monkeypatch):
    held = {0: torch.tensor([1.0, 3.0e8]), 2: torch.tensor([1.0e8, 1.0]), 5: torch.tensor([-1.0e8, -3.0e8])}
    expected = (held[0].clone().add_(held[2])).add_(held[5])  # rank order: 1 + 1e8 rounds, then - 1e8
    assert not torch.equal(expected, (held[2] + held[5]) + held[0])  # the order shows in fp32
    sums = []
    for rank in held:
        fake = _FakeP2P(held)
        monkeypatch.setattr(grad_sync, "dist", fake)
        param = _param(2)
        param.grad = held[rank].clone()
        sum_shared_gradients([(param, [0, 2, 5])], rank=rank, group="pp-group")
        assert sorted(peer for peer, _ in fake.sent) == sorted({0, 2, 5} - {rank})
        assert all(torch.equal(t, held[rank]) for _, t in fake.sent)  # this rank's own gradient, not the sum
        sums.append(param.grad)
    assert all(torch.equal(s, expected) for s in sums)


def test_a_weight_without_a_gradient_sends_zeros_and_one_held_nowhere_else_is_left_alone(monkeypatch):
    fake = _FakeP2P({1: torch.tensor([2.0, 5.0])})
    monkeypatch.setattr(grad_sync, "dist", fake)
    tied, alone = _param(2), _param(3)
    sum_shared_gradients([(alone, [0]), (tied, [0, 1])], rank=0, group="pp-group")
    assert alone.grad is None
    assert [(peer, t.tolist()) for peer, t in fake.sent] == [(1, [0.0, 0.0])]
    torch.testing.assert_close(tied.grad, torch.tensor([2.0, 5.0]))


# -- GradientSync ------------------------------------------------------------------------------------
def _plan(*, dp=2, zero_stage=0, mode="ddp", bucket_mb=25.0, experts=()):
    return SimpleNamespace(mesh=SimpleNamespace(dp=dp), dims=ParallelDims(dp=dp), zero_stage=zero_stage,
                           data_parallel=mode, bucket_mb=bucket_mb, expert_params=tuple(experts))


def _ctx(dp=2, rank=0) -> RankContext:
    info = MeshInfo(MeshShape(dp=dp), rank, {"dp": rank, "pp": 0, "tp": 0},
                    groups={"dp": "dp-group", "pp": "pp-group", "edp": "edp-group"},
                    axis_ranks={"dp": list(range(dp)), "pp": [rank], "tp": [rank], "edp": [5, 7]})
    return RankContext.create(info, timeout_s=5.0)


def _named():
    """Four trainable parameters of 10 floats (40 bytes each), a frozen one, a tied one and two experts."""
    names = ["a", "b", "c", "d"]
    named = [(n, _param(10, fill=i + 1.0)) for i, n in enumerate(names)]
    named += [("frozen", _param(10, requires_grad=False)), ("tied", _param(2)), ("e0", _param(2)), ("e1", _param(2))]
    return named


def _bucket_names(buckets) -> list[set[str]]:
    return [set(b.names) for b in buckets.buckets]


@pytest.mark.parametrize("plan", [_plan(dp=1, experts=("e0", "e1")), _plan(mode="dataparallel", experts=("e0", "e1"))],
                         ids=["dp1", "dataparallel"])
def test_nothing_is_synced_where_dp_does_not_reduce_here(plan):
    named = _named()
    sync = GradientSync(named, ctx=_ctx(), shared=[], plan=plan, owners=None, uses={})
    assert sync.buckets is None and sync.post is None and sync.launch_log() == []
    assert sync.experts == []


def test_zero3_buckets_nothing_and_syncs_the_experts_it_leaves_whole():
    named = _named()
    sync = GradientSync(named, ctx=_ctx(), shared=[], plan=_plan(zero_stage=3, experts=("e0", "e1")), owners=None,
                        uses={})
    assert sync.buckets is None and sync.post is None and sync.launch_log() == []
    assert sync.experts == [dict(named)["e0"], dict(named)["e1"]]


@pytest.mark.parametrize("zero_stage,keep_unowned", [(0, True), (1, True), (2, False)])
def test_ddp_buckets_hold_the_trainable_parameters_tied_ones_after_backward(zero_stage, keep_unowned):
    named = _named()
    by_name = dict(named)
    shared = [(by_name["tied"], [0, 1])]
    sync = GradientSync(named, ctx=_ctx(), shared=shared, plan=_plan(zero_stage=zero_stage, bucket_mb=100 / 2**20,
                                                                     experts=("e0", "e1")),
                        owners=None if zero_stage == 0 else dict.fromkeys(["a", "b", "c", "d", "tied"], 0), uses={})
    assert _bucket_names(sync.buckets) == [{"d", "c"}, {"b", "a"}]  # 100 bytes: two of 40 per bucket
    assert _bucket_names(sync.post) == [{"tied"}]
    assert (sync.buckets.overlap, sync.post.overlap) == (True, False)
    assert sync.buckets.keep_unowned is keep_unowned and sync.post.keep_unowned is keep_unowned
    assert sync.experts == [by_name["e0"], by_name["e1"]] and sync.expert_dst is None


def test_a_zero3_shard_reduced_in_the_graph_is_not_an_expert_to_sync(monkeypatch):
    monkeypatch.setattr(grad_sync, "zero3_targets", lambda gm: ["e1"] if gm == "stage graph" else [])
    named = _named()
    sync = GradientSync(named, ctx=_ctx(), shared=[], plan=_plan(zero_stage=3, experts=("e0", "e1")), owners=None,
                        uses={}, zero3_runtimes=(SimpleNamespace(gm="stage graph"),))
    assert sync.experts == [dict(named)["e0"]] and sync.buckets is None


@pytest.mark.parametrize("zero_stage,dst", [(2, [7, 5]), (1, None)])
def test_zero2_reduces_each_expert_gradient_to_its_edp_owner(zero_stage, dst):
    named = _named()
    sync = GradientSync(named, ctx=_ctx(), shared=[], plan=_plan(zero_stage=zero_stage, experts=("e0", "e1")),
                        owners=dict.fromkeys(["a", "b", "c", "d", "tied"], 0), uses={},
                        expert_owners={"e0": 1, "e1": 0})
    assert sync.expert_dst == dst


def test_finish_runs_the_buckets_experts_zero3_shared_weights_then_the_post_buckets_in_order(monkeypatch):
    events = []

    def all_reduce(t, **kw):
        events.append(("all_reduce", t.numel()))
        t.mul_(2)  # two equal ranks
        return _Done()

    monkeypatch.setattr(ddp_buckets.comm, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_sync, "sync_expert_gradients",
                        lambda params, **kw: events.append(("experts", len(params), kw)))
    monkeypatch.setattr(grad_sync, "sum_shared_gradients",
                        lambda shared, **kw: events.append(("shared", len(shared), kw["rank"], kw["group"])))
    monkeypatch.setattr(grad_sync, "zero3_targets", lambda gm: [])
    named = _named()
    by_name = dict(named)
    runtime = SimpleNamespace(gm=None, drain=lambda: events.append(("drain",)))
    sync = GradientSync(named, ctx=_ctx(dp=2, rank=1), shared=[(by_name["tied"], [1, 3])],
                        plan=_plan(experts=("e0", "e1")), owners=None, uses={}, zero3_runtimes=(runtime,),
                        current_action=lambda: "0F1")
    origin = time.perf_counter() - 1000.0
    sync.begin(1)
    for n in ("a", "b", "c", "d", "tied"):
        by_name[n].grad = torch.ones(by_name[n].shape)
    sync.finish()
    experts_kw = {"group": "edp-group", "size": 2, "dp": 2, "guard": sync.guard, "owners": None, "rank": 1}
    assert events == [("all_reduce", 40), ("experts", 2, experts_kw), ("drain",), ("shared", 1, 1, "pp-group"),
                      ("all_reduce", 2)]
    for n in ("a", "b", "c", "d", "tied"):
        torch.testing.assert_close(by_name[n].grad, torch.ones(by_name[n].shape))  # summed over 2, divided by 2
    log = sync.launch_log(origin)
    assert [(b, action) for b, action, _ in log] == [(0, "0F1")]
    assert all(1000.0 <= t < 1060.0 for _, _, t in log)
    assert all(0.0 <= t < 60.0 for _, _, t in sync.launch_log())  # from begin's instant


def test_begin_arms_the_buckets_for_the_steps_microbatches(monkeypatch):
    monkeypatch.setattr(ddp_buckets.comm, "all_reduce", lambda t, **kw: _Done())
    named = _named()
    sync = GradientSync(named, ctx=_ctx(), shared=[], plan=_plan(), owners=None, uses={"a": 2})
    sync.begin(3)
    assert sync.buckets.armed and sync.buckets.expected["a"] == 6 and sync.buckets.expected["b"] == 3
