"""Data-parallel pieces that need no process group: bucket plans, ZeRO checks, theory, errors."""
from __future__ import annotations

import copy
import pytest
import torch

from autopar.errors import PlanError
from autopar.ops.comm_audit import CommLog, theory_bytes
from autopar.options import CompileOptions
from autopar.parallel_dims import ParallelDims
from autopar.plan_model import MeshShape
from autopar.runtime.state.ddp_buckets import plan_buckets
from autopar.runtime.execution.rank_context import AxisGroup, MeshInfo
from autopar.runtime.state.zero import ShardedOptimizer, check_elementwise, stepped_here


def _named(sizes):
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_buckets_follow_reverse_use_order_and_cap():
    buckets = plan_buckets(_named([10, 10, 10, 10]), bucket_bytes=80, owners=None)
    assert [b.names for b in buckets] == [["p3", "p2"], ["p1", "p0"]]


def test_zero_buckets_hold_one_owner_each():
    owners = {"p0": 0, "p1": 1, "p2": 0, "p3": 1}
    buckets = plan_buckets(_named([10, 10, 10, 10]), bucket_bytes=1000, owners=owners)
    assert {tuple(b.names): b.owner for b in buckets} == {("p3", "p1"): 1, ("p2", "p0"): 0}


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_bf16_masters_are_kept_where_the_optimizer_steps(zero_stage):
    """The program gives a parameter an fp32 master exactly where ShardedOptimizer will step it."""
    named = _named([30, 20, 10, 5, 5])
    seen = set()
    for rank in range(3):
        opt = ShardedOptimizer(named, lambda ps: torch.optim.SGD(ps, lr=0.1), zero_stage=zero_stage,
                               dp=AxisGroup(group=None, ranks=(0, 1, 2), index=rank))
        mine = stepped_here(named, zero_stage=zero_stage, dims=ParallelDims(dp=3), coords={"dp": rank})
        assert mine == set(opt.stepped_names()) and not mine & seen
        seen |= mine
    assert seen == {n for n, _ in named}
    assert stepped_here(named, zero_stage=3, dims=ParallelDims(dp=3), coords={"dp": 0}) is None
    assert stepped_here(named, zero_stage=zero_stage, dims=ParallelDims(dp=1), coords={"dp": 0}) is None


@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("dp,ep", [(4, 2), (2, 2)])
def test_bf16_masters_of_experts_follow_their_edp_owner(zero_stage, dp, ep):
    """MoE experts split over ep are partitioned over edp (the dp/ep ranks holding the same experts) under
    ZeRO-1/2: each is stepped by one rank of its edp group, its fp32 master there too (with dp == ep every
    holder steps its own; a master set that disagreed with the optimizer failed the first bf16 step)."""
    named = _named([30, 20, 10, 5, 5, 7])
    local = frozenset({"p1", "p3", "p5"})
    shared, experts_by_edp_group = set(), {}
    for rank in range(dp):
        edp = AxisGroup(group=None, ranks=tuple(range(rank % ep, dp, ep)), index=rank // ep)
        opt = ShardedOptimizer(named, lambda ps: torch.optim.SGD(ps, lr=0.1), zero_stage=zero_stage,
                               dp=AxisGroup(group=None, ranks=tuple(range(dp)), index=rank), local=local, edp=edp)
        mine = stepped_here(named, zero_stage=zero_stage, dims=ParallelDims(dp=dp, ep=ep), coords={"dp": rank},
                            local=local)
        assert mine == set(opt.stepped_names()) and not (mine - local) & shared
        shared |= mine - local
        seen = experts_by_edp_group.setdefault(rank % ep, set())
        assert not (mine & local) & seen
        seen |= mine & local
        owners = opt.expert_owner_of()
        assert (owners is None) == (dp == ep)
        if owners is not None:
            assert {n for n, k in owners.items() if k == rank // ep} == mine & local
    assert shared == {n for n, _ in named} - local
    assert all(seen == local for seen in experts_by_edp_group.values())


def test_zero3_theory_is_one_and_a_half_ddp():
    ddp = theory_bytes(zero_stage=0, param_bytes=1000, dp=4)
    assert ddp == 1500
    assert theory_bytes(zero_stage=1, param_bytes=1000, dp=4) == ddp
    assert theory_bytes(zero_stage=2, param_bytes=1000, dp=4) == ddp
    assert theory_bytes(zero_stage=3, param_bytes=1000, dp=4) == 1.5 * ddp
    assert theory_bytes(zero_stage=3, param_bytes=1000, dp=1) == 0


def test_comm_log_sums_by_purpose():
    log = CommLog()
    log.add("all_reduce", "grad_all_reduce", 100, 100.0, 2)
    log.add("broadcast", "param_broadcast", 100, 50.0, 2)
    assert log.sent_bytes() == 150 and log.by_purpose() == {"grad_all_reduce": 100.0, "param_broadcast": 50.0}


def test_zero3_refuses_non_elementwise_optimizers():
    check_elementwise(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(PlanError, match="zero_stage=2"):
        ShardedOptimizer(_named([4, 4]), lambda ps: torch.optim.Adafactor(ps), zero_stage=3,
                         dp=AxisGroup(group=None, ranks=(0, 1), index=0))
    # ZeRO-1/2 own whole parameters: any optimizer is fine
    ShardedOptimizer(_named([4, 4]), lambda ps: torch.optim.Adafactor(ps), zero_stage=2,
                     dp=AxisGroup(group=None, ranks=(0, 1), index=0))


def _info(pp: int) -> MeshInfo:
    return MeshInfo(MeshShape(dp=2, pp=pp), 0, {"dp": 0, "pp": 0, "tp": 0})


@pytest.mark.parametrize("info,options,match", [
    (_info(2), {}, "pp=2"),
    (_info(1), {"zero_stage": 2}, "zero_stage=2"),
    (_info(1), {"num_microbatches": 2}, "one pass"),
])
def test_dataparallel_refuses_what_it_cannot_run(info, options, match):
    from autopar.data_parallel import compile_data_parallel
    opts = CompileOptions(data_parallel="dataparallel", **options)
    with pytest.raises(PlanError, match=match):
        compile_data_parallel(torch.nn.Linear(2, 2), info=info, opts=opts, example_inputs=(torch.zeros(2, 2),),
                              example_target=torch.zeros(2, 2), loss_fn=torch.nn.functional.mse_loss,
                              optimizer_factory=None)


def test_dataparallel_needs_a_loss():
    from autopar.data_parallel import compile_data_parallel
    with pytest.raises(PlanError, match="needs a loss"):
        compile_data_parallel(torch.nn.Linear(2, 2), info=_info(1), opts=CompileOptions(data_parallel="dataparallel"),
                              example_inputs=(torch.zeros(2, 2),), example_target=None, loss_fn=None,
                              optimizer_factory=None)


class _DoneWork:
    def wait(self):
        return True


def _buckets_summing_two_equal_ranks(monkeypatch, named, overlap=False):
    """GradBuckets over a dp of 2 whose all-reduce adds an equal rank's gradient (no process group)."""
    from autopar.runtime.state import ddp_buckets

    def all_reduce(t, **_):
        t.mul_(2)
        return _DoneWork()

    monkeypatch.setattr(ddp_buckets.comm, "all_reduce", all_reduce)
    dp = AxisGroup(group=None, ranks=(0, 1), index=0)
    return ddp_buckets.GradBuckets(named, dp=dp, bucket_bytes=1 << 20, overlap=overlap)


def _accumulate_as_autograd(param, grad):
    """What autograd's AccumulateGrad does with a new gradient: take it, or add into the kept one."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def test_a_kept_bucket_reuses_its_flat_buffer_and_its_gradients_view_it(monkeypatch):
    named = _named([3, 5])
    buckets = _buckets_summing_two_equal_ranks(monkeypatch, named)
    (_, pa), (_, pb) = named
    storages = []
    for ga, gb in [(torch.arange(3.0), torch.ones(5)), (torch.full((3,), 7.0), None)]:
        pa.grad = pb.grad = None  # as the program's zero_grad does before a step
        buckets.begin(1)
        _accumulate_as_autograd(pa, ga.clone())
        if gb is not None:
            _accumulate_as_autograd(pb, gb.clone())
        buckets.finish()
        torch.testing.assert_close(pa.grad, ga)
        torch.testing.assert_close(pb.grad, torch.zeros(5) if gb is None else gb)  # no gradient counts as zero
        storages.append({p.grad.untyped_storage().data_ptr() for p in (pa, pb)})
    assert len(storages[0]) == 1 and storages[0] == storages[1]  # one buffer, the same in both steps


def test_after_the_first_step_backward_accumulates_into_the_zeroed_buffer(monkeypatch):
    named = _named([3, 5])
    buckets = _buckets_summing_two_equal_ranks(monkeypatch, named, overlap=True)
    (_, pa), (_, pb) = named
    buckets.begin(1)
    pa.grad, pb.grad = torch.ones(3), torch.full((5,), 2.0)
    buckets.finish()
    buffer = pa.grad.untyped_storage().data_ptr()
    pa.grad = pb.grad = None
    buckets.begin(2)  # the last step's sums are gone: the views start at zero
    assert {p.grad.untyped_storage().data_ptr() for p in (pa, pb)} == {buffer}
    torch.testing.assert_close(pa.grad, torch.zeros(3))
    for _ in range(2):  # two microbatches add into the views in place
        _accumulate_as_autograd(pa, torch.ones(3))
    pb.grad = torch.full((5,), 4.0)  # one gradient was replaced by a tensor of its own
    buckets.finish()
    torch.testing.assert_close(pa.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(pb.grad, torch.full((5,), 4.0))
    assert {p.grad.untyped_storage().data_ptr() for p in (pa, pb)} == {buffer}


def test_buckets_reduced_after_backward_keep_the_gradients_they_are_given(monkeypatch):
    """Without overlap (tied weights, summed across stages first) begin comes after the gradients."""
    named = _named([3, 5])
    buckets = _buckets_summing_two_equal_ranks(monkeypatch, named)
    (_, pa), (_, pb) = named
    for step in range(2):
        pa.grad, pb.grad = torch.full((3,), 1.0 + step), torch.full((5,), 2.0)
        buckets.begin(1)
        buckets.finish()
        torch.testing.assert_close(pa.grad, torch.full((3,), 1.0 + step))


def test_a_launched_bucket_frees_the_gradients_autograd_made_before_backward_ends(monkeypatch):
    """Its gradients become buffer views at launch: the rest of backward reuses their memory."""
    import weakref
    from autopar.runtime.state import ddp_buckets
    monkeypatch.setattr(ddp_buckets.comm, "all_reduce", lambda t, **_: (t.mul_(2), _DoneWork())[1])
    early, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    made = {}  # registered before the buckets' hooks: sees the gradient autograd made
    last.weight.register_post_accumulate_grad_hook(lambda p: made.update({"last.weight": weakref.ref(p.grad)}))
    named = [("early.weight", early.weight), ("early.bias", early.bias),
             ("last.weight", last.weight), ("last.bias", last.bias)]
    buckets = ddp_buckets.GradBuckets(named, dp=AxisGroup(group=None, ranks=(0, 1), index=0),
                                      bucket_bytes=80, overlap=True)
    assert [b.names for b in buckets.buckets] == [["last.bias", "last.weight"], ["early.bias", "early.weight"]]

    def reaching_early(grad):  # after last's gradients were accumulated and its bucket launched
        made["alive"] = made["last.weight"]() is not None
        made["in buffer"] = _inside_buffer(last.weight, buckets.buckets[0])
        return grad

    x = torch.ones(2, 4)
    buckets.begin(1)
    hidden = early(x)
    hidden.register_hook(reaching_early)
    last(hidden).sum().backward()
    assert (made["alive"], made["in buffer"]) == (False, True)
    buckets.finish()
    ref_early, ref_last = copy.deepcopy(early), copy.deepcopy(last)
    for p in (*ref_early.parameters(), *ref_last.parameters()):
        p.grad = None
    ref_last(ref_early(x)).sum().backward()
    for p, q in [(early.weight, ref_early.weight), (last.weight, ref_last.weight)]:
        torch.testing.assert_close(p.grad, q.grad)  # all-reduced over two equal ranks and divided by 2


def _inside_buffer(param, bucket):
    return param.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
