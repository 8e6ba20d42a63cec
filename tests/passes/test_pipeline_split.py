"""passes/pipeline/pipeline_split.py: stage graphs joined by visible send/recv nodes, parameters placed once."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from autopar.ops.p2p import RecvActivation, SendActivation, p2p_nodes

from graph_runner import planned, reference_loss, run_forward

FOUR = (("num_layers", 4),)
CASES = [("gpt_tiny", 2, 1), ("gpt_tiny", 4, 1), ("llama_tiny", 2, 1), ("gpt_tiny", 2, 2)]
IDS = [f"{n}-pp{p}-tp{t}" for n, p, t in CASES]


def _plan(name, pp, tp=1):
    return planned(name, pp=pp, tp=tp, overrides=FOUR, batch=8)


def _stages(result, tp_rank: int = 0):
    """Every stage graph of dp replica 0 and one tp rank, in stage order."""
    return sorted((s for r in result.ranks.values() if r.coords["dp"] == 0 and r.coords["tp"] == tp_rank
                   for s in r.stages), key=lambda s: s.stage)


@pytest.mark.parametrize("name,pp,tp", CASES, ids=IDS)
def test_sends_and_recvs_pair_up(name, pp, tp):
    _, _, _, result = _plan(name, pp, tp)
    stages = _stages(result)
    assert [s.stage for s in stages] == list(range(pp)) and [s.is_last for s in stages] == [False] * (pp - 1) + [True]
    sends = [e for s in stages for e in s.sends]
    recvs = [e for s in stages for e in s.recvs]
    assert sends and sorted(sends, key=lambda e: e.index) == sorted(recvs, key=lambda e: e.index)
    assert len({e.index for e in sends}) == len(sends)
    mb = result.plan.microbatch_size
    for stage in stages:
        assert all(e.src == stage.stage < e.dst for e in stage.sends)
        assert all(e.dst == stage.stage for e in stage.recvs)
        modules = {type(stage.gm.get_submodule(n.target)) for n in p2p_nodes(stage.gm)}
        assert len(p2p_nodes(stage.gm)) == len(stage.sends) + len(stage.recvs)
        assert modules <= {SendActivation, RecvActivation}
        for e in stage.sends:
            send = stage.gm.get_submodule(f"send_{e.index}")
            assert (send.edge, send.dst_stage, tuple(send.shape), send.dtype) == (e.index, e.dst, e.shape, e.dtype)
        for e in stage.recvs:
            recv = stage.gm.get_submodule(f"recv_{e.index}")
            assert (recv.edge, recv.src_stage, tuple(recv.shape), recv.dtype) == (e.index, e.src, e.shape, e.dtype)
    hidden = _plan(name, pp, tp)[0].cfg.hidden
    assert all(e.shape == (mb, 16, hidden) and e.dtype == torch.float32 and e.requires_grad for e in sends)


@pytest.mark.parametrize("name,pp,tp", CASES, ids=IDS)
def test_tp_ranks_of_a_stage_exchange_the_same_edges(name, pp, tp):
    _, _, _, result = _plan(name, pp, tp)
    for t in range(1, tp):
        assert [(s.sends, s.recvs) for s in _stages(result, t)] == [(s.sends, s.recvs) for s in _stages(result)]


def test_tied_weight_sits_on_the_first_and_last_stage_and_is_shared():
    for pp in (2, 4):
        _, _, _, result = _plan("gpt_tiny", pp)
        stages = _stages(result)
        holders = [s.stage for s in stages if "model.lm_head.weight" in s.param_names]
        assert holders == [0, pp - 1]
        assert result.plan.shared_params == {"lm_head.weight": (0, pp - 1)}
        assert f"lm_head.weight on stages [0, {pp - 1}]" in result.summary()
    _, _, _, untied = _plan("llama_tiny", 2)
    assert untied.plan.shared_params == {}


def test_stage_graphs_print_readable_recv_and_send_calls():
    _, _, _, result = _plan("gpt_tiny", 2)
    first, last = _stages(result)
    assert "= self.send_0(" in first.gm.code and "recv_" not in first.gm.code
    assert "recv_0 = self.recv_0()" in last.gm.code and "send_" not in last.gm.code
    text = result.describe_rank(1)
    assert "# rank 1: dp=0 pp=1 tp=0" in text and "## stage 1: inputs ['target']" in text
    assert "1 recv, 0 send" in text and "self.recv_0()" in text and "## schedule for pp rank 1" in text


def test_graph_inputs_are_read_only_where_needed():
    _, _, _, result = _plan("gpt_tiny", 4)
    assert [s.input_names for s in _stages(result)] == [("idx",), (), (), ("target",)]


@pytest.mark.parametrize("name,pp,tp", CASES, ids=IDS)
def test_every_parameter_lives_on_exactly_one_stage_except_the_tied_one(name, pp, tp):
    model, _, _, result = _plan(name, pp, tp)
    counts = Counter()
    for stage in _stages(result):
        for graph_name in stage.param_names:
            counts[id(model.get_parameter(graph_name.removeprefix("model.")))] += 1
    expected = {id(p): 1 for p in model.parameters()}  # parameters() lists a tied tensor once
    if name == "gpt_tiny":
        expected[id(model.tok_emb.weight)] = 2
    assert dict(counts) == expected


@pytest.mark.parametrize("name,pp,tp", CASES, ids=IDS)
def test_stages_run_in_order_compute_the_model_loss(name, pp, tp):
    model, x, y, result = _plan(name, pp, tp)
    mb = result.plan.microbatch_size
    losses = run_forward(result, {"idx": x[:mb], "target": y[:mb]})
    for loss in losses:
        torch.testing.assert_close(loss[0], reference_loss(model, x[:mb], y[:mb]), rtol=1e-5, atol=1e-6)
