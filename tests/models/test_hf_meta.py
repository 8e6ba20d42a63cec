"""Hugging Face families as users hold them, built under ``torch.device("meta")``, plan at pp=2 x tp=2.

Each family is the library's own class from a small config of its own (autopar.models.hf.HF_RAW).
Planning never allocates a weight: the model's tensors and every rank's stage-graph tensors stay
on meta. Whatever the trace bakes in about the meta device (``_assert_tensor_metadata``, device
constants, meta buffers such as rotary ``inv_freq``) is handled by one rule in capture, not per family.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.ir.captured_graph import ItemCount  # noqa: E402
from autopar.models.hf import HF_RAW, build_hf_raw  # noqa: E402
from autopar.passes.frontend.devices import graph_devices  # noqa: E402

FAMILIES = ("llama", "gpt2", "mistral", "qwen3", "mixtral", "bert", "phi3", "gemma")


def logits_loss(output, target):
    """Cross entropy over the vocabulary, reading the ModelOutput's logits."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _graph_tensors(gm: torch.fx.GraphModule):
    yield from gm.parameters()
    yield from gm.buffers()
    for module in gm.modules():
        yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))


def test_families_cover_the_issue():
    assert set(FAMILIES) <= set(HF_RAW) and len(FAMILIES) >= 8


@pytest.mark.parametrize("name", FAMILIES)
def test_meta_built_family_plans_without_allocating(name):
    model = build_hf_raw(name, device="meta", use_cache=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 8), generator=gen)
    targets = torch.randint(0, 128, (4, 8), generator=gen)
    result = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=(tokens,), loss_fn=logits_loss,
                          example_target=targets)
    assert result.plan.mesh.pp == 2 and result.plan.mesh.tp == 2
    assert result.plan.param_shards, "tensor parallelism sharded nothing"
    assert all(t.is_meta for t in model.parameters()) and all(t.is_meta for t in model.buffers())
    for rank in result.ranks.values():
        for stage in rank.stages:
            real = [tuple(t.shape) for t in _graph_tensors(stage.gm) if not t.is_meta]
            assert not real, f"rank {rank.rank} stage {stage.stage} holds real tensors {real[:3]}"
            assert all(d.type != "meta" for d in graph_devices(stage.gm))


def _sharded_share(model, result) -> float:
    """Share of the elements of >= 2-dim weights that tensor parallelism shards."""
    weights = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2}
    return sum(v for n, v in weights.items() if n in result.plan.param_shards) / sum(weights.values())


def test_library_defaults_shard_as_fully_as_caches_off(caplog):
    """use_cache=True (the default) is switched off for capture, with one log line; the user's config stays."""
    tokens, targets = torch.randint(0, 128, (4, 8)), torch.randint(0, 128, (4, 8))
    shares = {}
    for use_cache in (True, False):
        model = build_hf_raw("llama", device="meta", use_cache=use_cache)
        with caplog.at_level("INFO", logger="autopar.passes.frontend.capture"):
            caplog.clear()
            result = autopar.plan(model, {"tp": 2}, example_inputs=(tokens,), loss_fn=logits_loss,
                                  example_target=targets)
        shares[use_cache] = _sharded_share(model, result)
        switched = [r for r in caplog.records if "use_cache switched off" in r.getMessage()]
        assert len(switched) == (1 if use_cache else 0)
        assert model.config.use_cache is use_cache
    assert shares[True] == shares[False] >= 0.95, shares


def test_dict_batch_keyword_inputs_and_the_models_own_loss():
    """A collator's dict batch: keyword inputs; with ``labels`` and no loss_fn the graph returns output.loss."""
    model = build_hf_raw("llama", device="meta")
    ids = torch.randint(1, 128, (4, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    result = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=batch)
    captured = result.captured.captured
    # the step's label-token count: one more input, counted after the causal LM's shift (passes/frontend/item_count.py)
    assert captured.input_names == ("input_ids", "attention_mask", "labels", "num_items_in_batch")
    assert captured.has_loss and captured.keywords == ("input_ids", "attention_mask", "labels")
    assert captured.item_count == ItemCount(labels="labels", shift=1)
    last = result.lowered[0].stages[-1]
    assert "num_items_in_batch" in last.input_names  # the loss's stage reads it
    assert _sharded_share(model, result) >= 0.95
    inference = autopar.plan(model, {"pp": 2}, example_inputs={"input_ids": ids, "attention_mask": mask})
    assert not inference.captured.captured.has_loss
    assert "CausalLMOutputWithPast" in str(inference.captured.captured.out_spec)  # the ModelOutput as it is


def test_a_loss_that_ignores_the_count_is_weighted_by_its_tokens():
    """BERT's masked-LM loss is torch's own mean: its forward takes **kwargs but never reads the count, so
    capture weighs the loss by its label tokens over the count (the form a count-reading loss has)."""
    model = build_hf_raw("bert", device="meta")
    ids = torch.randint(1, 128, (4, 8))
    labels = ids.masked_fill(torch.rand(4, 8, generator=torch.Generator().manual_seed(0)) < 0.5, -100)
    captured = autopar.plan(model, {"pp": 1}, example_inputs={"input_ids": ids, "labels": labels}).captured.captured
    assert captured.input_names == ("input_ids", "labels", "num_items_in_batch") and captured.has_loss
    assert captured.item_count == ItemCount(labels="labels", shift=0)  # a masked LM: no shift


@pytest.mark.parametrize("name", ["t5", "bert", "gpt2"])
def test_a_mean_loss_over_padded_labels_trains_like_the_librarys_own_loop(name, one_rank_mesh):
    """T5 and BERT compute their loss as the mean over the call's label tokens; GPT-2 reads the count, but
    its ``loss_type`` is None (transformers.Trainer would count its labels unshifted) while its loss
    shifts them (the graph's ``labels[..., 1:]``). With 2 microbatches of unequal label padding, the step
    weighs every token as one call over the whole batch does: losses and weights equal the library's own
    loop (model(**batch).loss, backward, step) over 3 steps."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 5:] = 0
    labels = torch.randint(3, 100, (4, 6) if name == "t5" else (4, 8), generator=g)
    labels[0, 4:] = -100  # microbatch 0 (rows 0-1) counts other tokens than microbatch 1 (rows 2-3)
    labels[2, 2:] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    overrides = {"t5": {"dropout_rate": 0.0},
                 "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                 "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}[name]
    torch.manual_seed(0)
    reference = build_hf_raw(name, **overrides)
    model = build_hf_raw(name, **overrides)
    model.load_state_dict(reference.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        expected.append(loss.item())
    program = autopar.compile(model, one_rank_mesh, example_inputs=batch, num_microbatches=2,
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    losses = [float(program.train_step(batch)) for _ in range(3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    state = program.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_a_count_in_the_batch_is_refused():
    from autopar.errors import CaptureError
    model = build_hf_raw("llama", device="meta")
    ids = torch.randint(1, 128, (4, 8))
    with pytest.raises(CaptureError, match="counts the step's label tokens itself") as info:
        autopar.plan(model, {"pp": 1}, example_inputs={"input_ids": ids, "labels": ids,
                                                       "num_items_in_batch": torch.full((4,), 32)})
    assert "drop 'num_items_in_batch'" in info.value.fix


def test_labels_without_a_model_loss_is_refused():
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, labels=None):
            return self.lin(x)

    from autopar.errors import CaptureError
    with pytest.raises(CaptureError, match="no scalar loss") as info:
        autopar.plan(NoLoss(), {"tp": 1}, example_inputs={"x": torch.randn(2, 4), "labels": torch.randn(2, 4)})
    assert "loss_fn" in info.value.fix


def _signature(gm):
    """Each node's op, target and shape: what a repeated graph shares with a full capture."""
    from autopar.ir.meta_keys import TENSOR, get_meta
    return [(n.op, type(gm.get_submodule(n.target)).__name__ if n.op == "call_module" else str(n.target),
             get_meta(n, TENSOR).shape if get_meta(n, TENSOR) else None) for n in gm.graph.nodes]


def test_hf_layers_are_captured_once_and_repeated(caplog):
    """transformers' blocks differ only in ``layer_idx`` (their position): a block template still applies."""
    model = build_hf_raw("llama", device="meta", num_hidden_layers=9)
    tokens = torch.randint(0, 128, (4, 8))
    with caplog.at_level("INFO", logger="autopar.passes.frontend.block_template"):
        once = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=(tokens,), loss_fn=logits_loss,
                            example_target=tokens, ranks=[0, 3])
    assert any("3 blocks captured, 6 repeated" in r.getMessage() for r in caplog.records)
    every = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=(tokens,), loss_fn=logits_loss,
                         example_target=tokens, ranks=[0, 3], block_capture="every")
    assert once.plan == every.plan
    for rank in (0, 3):
        for a, b in zip(once.ranks[rank].stages, every.ranks[rank].stages):
            assert _signature(a.gm) == _signature(b.gm)
            assert dict(a.gm.named_parameters()).keys() == dict(b.gm.named_parameters()).keys()


def test_dict_batch_with_a_non_tensor_entry_is_refused():
    from autopar.errors import PlanError
    model = build_hf_raw("llama", device="meta")
    with pytest.raises(PlanError, match="maps names to tensors") as info:
        autopar.plan(model, {"tp": 1}, example_inputs={"input_ids": torch.zeros(2, 4, dtype=torch.long),
                                                        "return_dict": True})
    assert "return_dict" in info.value.where


def test_dataparallel_baseline_refuses_the_models_own_loss(one_rank_mesh):
    """The rank-0 baseline computes the loss from gathered outputs: a labels batch without loss_fn is refused."""
    from autopar.errors import PlanError
    model = build_hf_raw("llama")
    ids = torch.randint(1, 128, (4, 8))
    with pytest.raises(PlanError, match="cannot train on the loss the model computes") as info:
        autopar.compile(model, one_rank_mesh, example_inputs={"input_ids": ids, "labels": ids},
                        data_parallel="dataparallel")
    assert "data_parallel='ddp'" in info.value.fix


def test_plan_auto_on_a_dict_batch_and_the_models_own_loss(one_rank_mesh):
    """The planner profiles the model's own loss on a dict batch (no loss_fn), for a planned world and
    for compile, whose step's loss is HF's own on the whole padded batch."""
    import copy
    ids = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(8) < torch.tensor([[8], [5], [7], [2]])).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    planned = autopar.plan(build_hf_raw("llama", device="meta"), 4, example_inputs=batch, plan="auto")
    assert planned.plan.mesh.world_size == 4 and planned.captured.captured.item_count is not None
    torch.manual_seed(0)
    model = build_hf_raw("llama")
    reference = copy.deepcopy(model)(**batch).loss
    program = autopar.compile(model, one_rank_mesh, example_inputs=batch, plan="auto", num_microbatches=2,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    torch.testing.assert_close(program.train_step(batch), reference, rtol=1e-5, atol=0)
