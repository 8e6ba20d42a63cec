"""Runner kinds for Hugging Face models as users hold them (``kind="hf_runners:<function>"``).

``case.model`` names a family of :data:`autopar.models.hf.HF_RAW`; ``case.overrides`` go to its config.
:func:`meta_train` builds the model under ``torch.device("meta")`` and compiles it (each rank
materialises only its pieces); :func:`cpu_reference` trains the same family built on CPU under the
same seed on one device. Both return what :func:`equivalence.assert_equivalent` compares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from equivalence import replica_record

SEED = 1234
VOCAB = 128


def logits_loss(output, target):
    """Cross entropy over the vocabulary, reading the ModelOutput's logits."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _build(case, device=None):
    from autopar.models.hf import build_hf_raw
    torch.manual_seed(SEED)
    return build_hf_raw(case.model, device=device, **dict(case.overrides))


def token_batches(case):
    """``case.steps`` batches of (token ids, targets), seeded."""
    g = torch.Generator().manual_seed(99)
    return [(torch.randint(0, VOCAB, (case.batch, case.seq), generator=g),
             torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)) for _ in range(case.steps)]


def sgd(case):
    """The cases' optimizer: SGD with momentum (equivalence.py says why)."""
    return lambda params: torch.optim.SGD(params, lr=case.lr, momentum=0.9)



def cpu_reference(case) -> dict:
    """One device, the model built on CPU under the same seed: losses and the final state_dict."""
    model = _build(case)
    opt = sgd(case)(list(model.parameters()))
    losses = []
    for x, y in token_batches(case):
        opt.zero_grad()
        loss = logits_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def meta_train(case, mesh) -> dict:
    """The family built on meta, compiled on ``mesh``: this rank's losses, state and held bytes."""
    import autopar
    from autopar.runtime.state.model_state import storage_bytes
    model = _build(case, device="meta")
    data = token_batches(case)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=logits_loss,
                              example_target=data[0][1], optimizer=sgd(case), p2p_timeout_s=120,
                              **dict(case.options))
    held = storage_bytes(p for _, p in program.named_params)
    local = {n: p.numel() for n, p in program.named_params}
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"losses": losses, "state": program.full_state_dict(), "held_bytes": held, "model_bytes": whole,
            "local_numel": local, "sharded": sorted(program.plan.param_shards),
            "still_meta": all(p.is_meta for p in model.parameters()), **replica_record(program)}


def padded_batches(case):
    """Dict batches as a data collator makes them: ``input_ids``, ``attention_mask``, ``labels`` (-100 on padding).

    Right padding of a different length on every row (a random order of 0, 1, 2, ... tokens):
    microbatches and dp slices carry different numbers of label tokens, which the model's own loss
    must count over the whole step (``num_items_in_batch``, docs/hf.md).
    """
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(case.steps):
        ids = torch.randint(1, VOCAB, (case.batch, case.seq), generator=g)
        pads = torch.randperm(case.batch, generator=g) % (case.seq - 1)
        mask = (torch.arange(case.seq) < (case.seq - pads).unsqueeze(1)).long()
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _train_reference(case, model, step) -> dict:
    opt = sgd(case)(list(model.parameters()))
    losses = []
    extra = dict(case.extra)
    for batch in (padded_batches(case) if extra.get("dict") or extra.get("dict_loss_fn") else token_batches(case)):
        opt.zero_grad()
        loss = step(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _without_labels(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def hf_loop_reference(case) -> dict:
    """HF's own single-device loop: ``loss = model(**batch).loss`` (dict cases) or the logits loss
    (``dict_loss_fn``: the dict batch less its labels, the labels as the logits loss's target)."""
    if dict(case.extra).get("dict_loss_fn"):
        return _train_reference(case, _build(case), lambda m, b: logits_loss(m(**_without_labels(b)), b["labels"]))
    if dict(case.extra).get("dict"):
        return _train_reference(case, _build(case), lambda m, b: m(**b).loss)
    return _train_reference(case, _build(case), lambda m, b: logits_loss(m(b[0]), b[1]))


def hf_train(case, mesh) -> dict:
    """The family as users hold it (``extra``: ``meta`` builds it on meta, ``dict`` trains on dict batches
    with labels and no loss_fn), compiled on ``mesh``: this rank's losses and the full state."""
    import autopar
    extra = dict(case.extra)
    model = _build(case, device="meta" if extra.get("meta") else None)
    common = dict(optimizer=sgd(case), p2p_timeout_s=120, **dict(case.options))
    if extra.get("dict_loss_fn"):  # a dict batch (no labels) and a loss_fn reading the ModelOutput's logits
        data = padded_batches(case)
        program = autopar.compile(model, mesh, example_inputs=_without_labels(data[0]), loss_fn=logits_loss,
                                  example_target=data[0]["labels"], **common)
        losses = [program.train_step(program.shard_batch(_without_labels(b)), target=program.shard_batch(b["labels"]))
                  .item() for b in data]
    elif extra.get("dict"):
        data = padded_batches(case)
        program = autopar.compile(model, mesh, example_inputs=data[0], **common)
        losses = [program.train_step(program.shard_batch(b)).item() for b in data]
    else:
        data = token_batches(case)
        program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=logits_loss,
                                  example_target=data[0][1], **common)
        losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    return {"losses": losses, "state": program.full_state_dict(), "use_cache": model.config.use_cache,
            "sharded": sorted(program.plan.param_shards),
            "gathered": [c for r in program.plan.tp_regions for c in r.gathered], **replica_record(program)}


def shifted_mean_loss(output, target):
    """A causal LM's loss written out: logits at i predict token i + 1, a mean over the labels not -100."""
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1).float(), target[:, 1:].flatten(), ignore_index=-100)


def own_loss_against_loss_fn(case, mesh) -> dict:
    """The same family and padded data compiled twice on ``mesh``: a dict batch on the model's own loss,
    and positional inputs with :func:`shifted_mean_loss`; both runs' losses and weights (after a flush)."""
    import autopar
    data = padded_batches(case)
    common = dict(optimizer=sgd(case), p2p_timeout_s=120, **dict(case.options))
    program = autopar.compile(_build(case), mesh, example_inputs=data[0], **common)
    own = [program.train_step(program.shard_batch(b)).item() for b in data]
    own_state = program.full_state_dict()
    record = replica_record(program)  # both programs' weights, compared across dp replicas (judge_ranks)
    program = autopar.compile(_build(case), mesh, example_inputs=(data[0]["input_ids"], data[0]["attention_mask"]),
                              loss_fn=shifted_mean_loss, example_target=data[0]["labels"], **common)
    positional = [program.train_step(program.shard_batch(b["input_ids"]), program.shard_batch(b["attention_mask"]),
                                     target=program.shard_batch(b["labels"])).item() for b in data]
    record["replica"].update({f"loss_fn.{k}": v for k, v in replica_record(program)["replica"].items()})
    return {"losses": own, "state": own_state,
            "reference": {"losses": positional, "state": program.full_state_dict()}, **record}


def _raw_batches(case):
    """The family's own kind of batch (tokens, images and labels, or a seq2seq dict), one per step."""
    from autopar.models.hf import hf_raw_example
    return [hf_raw_example(case.model, batch=case.batch, seq=case.seq, seed=step) for step in range(case.steps)]


def raw_reference(case) -> dict:
    """One device, any :data:`autopar.models.hf.HF_RAW` family on its own batches and loss."""
    model = _build(case)
    opt = sgd(case)(list(model.parameters()))
    losses = []
    for inputs, loss_fn, target in _raw_batches(case):
        opt.zero_grad()
        loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def raw_train(case, mesh) -> dict:
    """Any HF_RAW family (vision, encoder-decoder) compiled on ``mesh``: losses, full state, what the plan shards."""
    import autopar
    model = _build(case)
    data = _raw_batches(case)
    inputs, loss_fn, target = data[0]
    program = autopar.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                              optimizer=sgd(case), p2p_timeout_s=120, **dict(case.options))

    def step(x, y):
        x = program.shard_batch(x) if isinstance(x, dict) else tuple(program.shard_batch(t) for t in x)
        return program.train_step(*([x] if isinstance(x, dict) else x), target=program.shard_batch(y)).item()

    losses = [step(x, y) for x, _, y in data]
    gathered = [c for r in program.plan.tp_regions for c in r.gathered]
    return {"losses": losses, "state": program.full_state_dict(), "sharded": sorted(program.plan.param_shards),
            "gathered": gathered, **replica_record(program)}
