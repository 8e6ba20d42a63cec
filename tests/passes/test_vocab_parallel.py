"""passes/tp/vocab_parallel.py: the embedding and the LM head + loss sharded on the vocabulary."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.ir.shard_layout import ShardLayout
from autopar.models import lm_loss
from autopar.ops.collectives import TpCopy, TpGather, TpReduce, collective_nodes
from autopar.ops.tp_ops import VocabParallelCrossEntropy

from graph_runner import example_batch, planned, tiny_model

VOCAB = (("vocab_parallel", True),)
HEADS = {"gpt_tiny": ("tok_emb", "lm_head"), "llama_tiny": ("embed_tokens", "lm_head"), "plain_tiny": ("tok", "out")}


def _modules(gm, kind):
    return [gm.get_submodule(n.target) for n in collective_nodes(gm, kind)]


@pytest.mark.parametrize("name", sorted(HEADS))
def test_embedding_and_head_hold_their_vocabulary_rows(name):
    model, _, _, result = planned(name, tp=2, options=VOCAB)
    emb, head = HEADS[name]
    assert result.plan.vocab_parallel == (emb, head)
    full = dict(model.named_parameters(remove_duplicate=False))
    for t in range(2):
        params = dict(result.graph(t).named_parameters())
        for path in (emb, head):
            if f"model.{path}.weight" not in params:
                continue  # GPT: one tied parameter, named after the head
            local = params[f"model.{path}.weight"].detach()
            expected = full[f"{path}.weight"].detach().chunk(2)[t]  # rows [t V/2, (t+1) V/2)
            assert torch.equal(local, expected)
            assert result.plan.param_shards[f"{path}.weight"] == ShardLayout(dim=0)


def test_tied_weight_gets_one_spec_read_by_both_uses():
    _, _, _, result = planned("gpt_tiny", tp=2, options=VOCAB)
    gm = result.graph(1)
    weight = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "model.lm_head.weight")
    users = {get_meta(u, MODULE).path for u in weight.users}
    assert users == {"model.tok_emb", "model.lm_head"}
    assert [k for k in result.plan.param_shards if "lm_head" in k or "tok_emb" in k] == ["lm_head.weight"]


@pytest.mark.parametrize("name", sorted(HEADS))
def test_rewrite_is_masked_lookup_all_reduce_and_vocab_parallel_loss(name):
    model, _, _, result = planned(name, tp=2, options=VOCAB)
    emb, head = HEADS[name]
    for t in range(2):
        gm = result.graph(t)
        reduces = [n for n in collective_nodes(gm, TpReduce) if get_meta(n, MODULE).path == f"model.{emb}"]
        copies = [n for n in collective_nodes(gm, TpCopy) if get_meta(n, MODULE).path == f"model.{head}"]
        assert len(reduces) == 1 and len(copies) == 1
        (loss,) = _modules(gm, VocabParallelCrossEntropy)
        assert (loss.vocab_start, loss.vocab_end) == (64 * t, 64 * (t + 1))
        assert not [n for n in gm.graph.nodes if "cross_entropy_loss" in str(n.target)]
        lookup = next(n for n in gm.graph.nodes if n.name == "vocab_lookup")
        assert "masked_fill" in str(lookup.args[1].target)  # ids outside the shard read row 0 ...
        zeroed = next(iter(lookup.users))
        assert "masked_fill" in str(zeroed.target)  # ... and are zeroed before the all-reduce
        views = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.reshape.default
                 and get_meta(n, MODULE) and list(n.args[1]) == [-1, model.cfg.vocab_size // 2]]
        assert views  # the logits view was rewritten to the local vocabulary


def test_pipeline_stages_hold_the_same_shard_of_the_tied_weight():
    _, _, _, result = planned("gpt_tiny", pp=2, tp=2, options=VOCAB)
    assert result.plan.shared_params["lm_head.weight"] == (0, 1)
    for t in range(2):
        first, last = result.lowered[t].stages
        a = first.gm.get_parameter("model.lm_head.weight")
        b = last.gm.get_parameter("model.lm_head.weight")
        assert a.shape == (64, 32) and torch.equal(a, b)


def test_inference_gathers_the_logits_before_the_output():
    model = tiny_model("llama_tiny")
    x, _ = example_batch(model.cfg.vocab_size)
    result = autopar.plan(model, {"tp": 2}, example_inputs=(x,))
    gm = result.graph(0)
    (gather,) = _modules(gm, TpGather)
    assert gather.dim == 2
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert output.args[0][0].op == "call_module" and output.args[0][0].target == "vocab_gather"
    assert result.plan.param_shards["lm_head.weight"] == ShardLayout(dim=0)


def test_vocabulary_not_divisible_by_tp_raises_sharding_error():
    model = tiny_model("llama_tiny", (("num_kv_heads", 4), ("vocab_size", 126)))
    x, y = example_batch(126)
    with pytest.raises(autopar.ShardingError) as info:
        autopar.plan(model, {"tp": 4}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, vocab_parallel=True)
    err = info.value
    assert "vocabulary size 126" in err.what and "tp=4" in err.what
    assert "model.embed_tokens" in err.where
    assert "128" in err.fix and "vocab_parallel=False" in err.fix


def test_vocabulary_not_divisible_stays_replicated_by_default(caplog):
    model = tiny_model("gpt_tiny", (("vocab_size", 126),))
    x, y = example_batch(126)
    with caplog.at_level(logging.WARNING, logger="autopar.passes.tp.vocab_parallel"):
        result = autopar.plan(model, {"tp": 4}, example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    assert "its vocabulary of 126 does not divide by tp=4" in caplog.text and "pad the vocabulary" in caplog.text
    assert result.plan.vocab_parallel == () and "lm_head.weight" not in result.plan.param_shards


def _smoothed(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), label_smoothing=0.1)


def test_unrecognised_loss_keeps_head_and_tied_embedding_replicated(caplog):
    model = tiny_model("gpt_tiny")
    x, y = example_batch(model.cfg.vocab_size)
    with caplog.at_level(logging.WARNING, logger="autopar.passes.tp.vocab_parallel"):
        result = autopar.plan(model, {"tp": 2}, example_inputs=(x,), loss_fn=_smoothed, example_target=y)
    text = caplog.text
    assert "model.lm_head" in text and "label_smoothing=0.1" in text and "stays replicated" in text
    assert "model.tok_emb stays replicated" in text
    assert result.plan.vocab_parallel == () and "lm_head.weight" not in result.plan.param_shards


def test_vocab_parallel_can_be_switched_off():
    _, _, _, result = planned("llama_tiny", tp=2)  # graph_runner plans with vocab_parallel=False
    assert result.plan.vocab_parallel == ()
    assert not _modules(result.graph(0), VocabParallelCrossEntropy)


class _Classifier(torch.nn.Module):
    """Token embedding, mean over the sequence, a 10-class head: classes that are no vocabulary."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


@pytest.mark.parametrize("tp,head_sharded", [(2, True), (4, False)])
def test_classifier_head_shards_only_when_its_classes_divide(tp, head_sharded, caplog):
    torch.manual_seed(0)
    x, y = torch.randint(0, 128, (4, 8)), torch.randint(0, 10, (4,))
    with caplog.at_level(logging.WARNING, logger="autopar.passes.tp.vocab_parallel"):
        result = autopar.plan(_Classifier(), {"tp": tp}, example_inputs=(x,), loss_fn=F.cross_entropy,
                              example_target=y)
    assert result.plan.vocab_parallel == (("emb", "head") if head_sharded else ("emb",))
    assert ("its 10 classes do not divide by tp=4" in caplog.text) != head_sharded


class _Padded(torch.nn.Module):
    """An embedding with a padding row (as BERT's, OPT's) and a learned position table."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(16, 8, padding_idx=5)
        self.pos = torch.nn.Embedding(4, 8)
        self.out = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.out(self.tok(x) + self.pos(torch.arange(x.shape[1])))


def test_padding_row_is_the_local_padding_row_of_the_rank_holding_it():
    torch.manual_seed(0)
    x, y = torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4))
    result = autopar.plan(_Padded(), {"tp": 2}, example_inputs=(x,), example_target=y,
                          loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    assert result.plan.param_shards["tok.weight"] == ShardLayout(dim=0)
    assert "pos.weight" not in result.plan.param_shards  # a position table stays replicated
    paddings = []
    for tp_rank in (0, 1):
        gm = result.lowered[tp_rank].stages[0].gm
        [lookup] = [n for n in gm.graph.nodes if n.name == "vocab_lookup"]
        paddings.append(lookup.args[2] if len(lookup.args) > 2 else None)
    assert paddings == [5, -1]  # rows 0..7 on rank 0 hold the padding row 5; rank 1 has none
