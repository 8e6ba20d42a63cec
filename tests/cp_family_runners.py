"""Runner kinds for context parallelism on transformers families (``kind="cp_family_runners:cp_train"``).

``case.model`` names a family of :data:`cp_families.CP_FAMILIES`; ``case.extra`` says how it is driven:
``impl`` (``sdpa`` or ``eager``), ``loss`` (``own``: dict batches with ``labels`` and the model's own loss, which
shifts the labels inside it; ``loss_fn``: the batch as tensors in the order of the forward's leading parameters
(:func:`tensor_inputs`: ``input_ids`` and ``attention_mask``, or ``input_ids`` alone where the forward takes a
cache second, as GPT-2 and Falcon do), the targets shifted by the data and a token-mean ``loss_fn`` on the
logits), ``packed`` (rows of several documents, ``position_ids`` restarting). :func:`cp_reference` trains the
same family on one device; both return what :func:`equivalence.assert_equivalent` compares.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from cp_families import build
from equivalence import replica_record
from tp_families import VOCAB


def _extra(case) -> dict:
    return {"impl": "sdpa", "loss": "own", **dict(case.extra)}


def logits_loss(output, target):
    """Token-mean cross entropy of the logits against targets already shifted (-100 ignored)."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)


def cp_batches(case) -> list[dict]:
    """Dict batches (``input_ids``, ``attention_mask`` right-padded by a different length on every row,
    ``labels`` -100 on padding), seeded; ``packed``: no padding, ``position_ids`` restarting at documents."""
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(case.steps):
        ids = torch.randint(1, VOCAB, (case.batch, case.seq), generator=g)
        if _extra(case).get("packed"):
            cuts = torch.randint(2, case.seq - 2, (case.batch,), generator=g)
            pos = torch.stack([torch.cat([torch.arange(int(c)), torch.arange(case.seq - int(c))]) for c in cuts])
            out.append({"input_ids": ids, "position_ids": pos, "labels": ids.clone()})
            continue
        pads = torch.randperm(case.batch, generator=g) % (case.seq // 2)
        mask = (torch.arange(case.seq) < (case.seq - pads).unsqueeze(1)).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def tensor_inputs(model, batch: dict) -> tuple:
    """The batch's tensors that fill the leading parameters of ``model.forward``, in order: positional tensors
    stop at the first parameter the batch does not hold (a ``cache`` between ``input_ids`` and ``attention_mask``)."""
    out = []
    for name in inspect.signature(model.forward).parameters:
        if name not in batch or name == "labels":
            break
        out.append(batch[name])
    return tuple(out)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _model(case):
    # (config fields the case changes, e.g. the sliding window, Mixtral's router loss: in the config it is built from)
    return build(case.model, _extra(case)["impl"], **dict(case.overrides))


def _sgd(case):
    return lambda params: torch.optim.SGD(params, lr=case.lr, momentum=0.9)


def cp_reference(case) -> dict:
    """One device: the model's own loss on the dict batches, or the loss_fn on the shifted targets."""
    model = _model(case)
    opt = _sgd(case)(list(model.parameters()))
    losses, norms = [], []
    max_norm = dict(case.options).get("max_grad_norm")
    for b in cp_batches(case):
        opt.zero_grad()
        if _extra(case)["loss"] == "own":
            loss = model(**b).loss
        else:
            loss = logits_loss(model(*tensor_inputs(model, b)), _shifted(b["labels"]))
        loss.backward()
        if max_norm is not None:  # torch's clipping is the reference for autopar's
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad_norms": norms}


def cp_train(case, mesh) -> dict:
    """The family compiled on ``mesh`` (its cp dim): this rank's losses, the full state, the Plan."""
    import autopar
    from autopar.runtime.diagnostics.memory_probe import held_state_bytes
    model, data = _model(case), cp_batches(case)
    common = dict(optimizer=_sgd(case), p2p_timeout_s=120, **dict(case.options))
    if _extra(case)["loss"] == "own":
        program = autopar.compile(model, mesh, example_inputs=data[0], **common)
        losses = [program.train_step(program.shard_batch(b)).item() for b in data]
    else:
        inputs = functools.partial(tensor_inputs, model)
        program = autopar.compile(model, mesh, example_inputs=inputs(data[0]), loss_fn=logits_loss,
                                  example_target=_shifted(data[0]["labels"]), **common)
        losses = [program.train_step(*(program.shard_batch(t) for t in inputs(b)),
                                     target=program.shard_batch(_shifted(b["labels"]))).item() for b in data]
    return {"losses": losses, "state": program.full_state_dict(), "plan": program.plan.model_dump_json(),
            "groups": {axis: program.info.axis_ranks.get(axis) for axis in ("ep", "edp", "edcp", "dcp")},
            "states": held_state_bytes(program),
            "last_grad_norm": None if program.last_grad_norm is None else program.last_grad_norm.item(),
            **replica_record(program)}


def cut_without_cp(case) -> tuple[str, ...]:
    """The stage starts ``autopar.plan`` gives the same family, batch and options on the case's mesh without cp:
    what a cp program's cut (balanced on each rank's FLOPs, its attention node counted) must equal."""
    import autopar
    model, data = _model(case), cp_batches(case)[0]
    options = {k: v for k, v in case.options if not k.startswith("cp_")}
    mesh = dict(zip(("dp", "pp", "tp"), case.mesh))
    if _extra(case)["loss"] == "own":
        result = autopar.plan(model, mesh, example_inputs=data, **options)
    else:
        result = autopar.plan(model, mesh, example_inputs=tensor_inputs(model, data), loss_fn=logits_loss,
                              example_target=_shifted(data["labels"]), **options)
    return tuple(result.plan.pipeline.stage_starts)


def cp_forward(case, mesh) -> dict:
    """Forward only on ``mesh``: this rank's logits for each batch (input_ids and attention_mask)."""
    import autopar
    model, data = _model(case), cp_batches(case)
    inputs = functools.partial(tensor_inputs, model)
    program = autopar.compile(model, mesh, example_inputs=inputs(data[0]), p2p_timeout_s=120, **dict(case.options))
    outputs = [program(*(program.shard_batch(t) for t in inputs(b))).logits for b in data]
    return {"outputs": outputs, "dp_index": program.info.coords["dp"], **replica_record(program)}


def cp_forward_reference(case) -> list:
    model = _model(case)
    with torch.no_grad():
        return [model(*tensor_inputs(model, b)).logits for b in cp_batches(case)]


class MeanPooled(torch.nn.Module):
    """Token embedding, a causal attention, the mean over the sequence added back to every position (a pooled
    summary, all-reduced over cp), an LM head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb, self.qkv = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, 3 * dim)
        self.mix, self.head = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.emb(x)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return self.head(h + self.mix(h.mean(dim=1, keepdim=True)))


def _pooled_data(case):
    g = torch.Generator().manual_seed(99)
    return [(torch.randint(0, VOCAB, (case.batch, case.seq), generator=g),
             torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)) for _ in range(case.steps)]


def _pooled_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def pooled_reference(case) -> dict:
    torch.manual_seed(5)
    model = MeanPooled()
    opt = _sgd(case)(list(model.parameters()))
    losses = []
    for x, y in _pooled_data(case):
        opt.zero_grad()
        loss = _pooled_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def pooled_train(case, mesh) -> dict:
    import autopar
    torch.manual_seed(5)
    model, data = MeanPooled(), _pooled_data(case)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=_pooled_loss,
                              example_target=data[0][1], optimizer=_sgd(case), p2p_timeout_s=120,
                              **dict(case.options))
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    return {"losses": losses, "state": program.full_state_dict(), **replica_record(program)}
