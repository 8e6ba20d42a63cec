"""Runner kinds for batches as a user's loader makes them (``kind="batch_runners:<function>"``, docs/batches.md).

``case.extra``: ``lengths`` (the longest sequence of each step's batch: transformers' collator pads
every batch to its own longest), ``rows`` (each step's global rows: an epoch's last batch is
smaller). The data is made once per step by ``DataCollatorForSeq2Seq`` (labels padded with -100)
from rows of random lengths, so every rank and the one-device reference see the same batches.

- :func:`hf_train` / :func:`hf_reference`: a transformers family (``case.model``, of
  ``autopar.models.hf.HF_RAW``) on dict batches, trained on its own loss;
- :func:`lm_train` / :func:`lm_reference`: ``gpt_tiny`` on token tensors with a token-mean ``loss_fn``;
- :func:`mse_train` / :func:`mse_reference`: a small MLP with a mean-squared-error ``loss_fn`` (a loss
  that is no token mean: a partial batch weighs its microbatches by their rows);
- :func:`refused`: a step autopar must refuse, on every rank, with its own error (``extra``'s
  ``bad``: the batch of the refused step as (rows, length)).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 1234
VOCAB = 128


def _collator():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")


def _plan(case) -> list[tuple[int, int]]:
    extra = dict(case.extra)
    lengths = extra.get("lengths") or (case.seq,) * case.steps
    rows = extra.get("rows") or (case.batch,) * len(lengths)
    return list(zip(rows, lengths))


def collated(case) -> list[dict]:
    """One collated dict batch per step: rows of random lengths, the first as long as the step's length."""
    g = torch.Generator().manual_seed(99)
    collate, out = _collator(), []
    for rows, length in _plan(case):
        sizes = [length] + torch.randint(2, length + 1, (rows - 1,), generator=g).tolist()
        features = []
        for n in sizes:
            ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
            features.append({"input_ids": ids, "labels": ids})
        out.append(dict(collate(features)))
    return out


def _sgd(case):
    return lambda params: torch.optim.SGD(params, lr=case.lr, momentum=0.9)


def _one_device(case, model, batches, step) -> dict:
    opt = _sgd(case)(list(model.parameters()))
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = step(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _parallel(case, mesh, model, batches, *, first, step) -> dict:
    import autopar
    program = autopar.compile(model, mesh, optimizer=_sgd(case), p2p_timeout_s=120, **first, **dict(case.options))
    losses = [step(program, b).item() for b in batches]
    shapes = program.batching.shapes  # the graphs built for other shapes, and the dims kept symbolic
    dims = (shapes.family or shapes.base).dynamic
    return {"losses": losses, "state": program.full_state_dict(), "built": shapes.num_built,
            "dynamic_dims": [d.describe() for d in dims]}


# -- transformers families on their own loss ----------------------------------------------------

def _hf(case):
    from autopar.models.hf import build_hf_raw
    torch.manual_seed(SEED)
    return build_hf_raw(case.model, **dict(case.overrides))


def hf_reference(case) -> dict:
    return _one_device(case, _hf(case), collated(case), lambda m, b: m(**b).loss)


def hf_train(case, mesh) -> dict:
    batches = collated(case)
    return _parallel(case, mesh, _hf(case), batches, first=dict(example_inputs=batches[0]),
                     step=lambda p, b: p.train_step(p.shard_batch(b)))


# -- gpt_tiny on tensors with a token-mean loss_fn ----------------------------------------------

def _tokens(case):
    return [(b["input_ids"], b["labels"]) for b in collated(case)]


def token_loss(logits, target):
    """Cross entropy over the tokens whose target is not -100 (a token mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)


def _gpt(case):
    from autopar.models import build_model
    torch.manual_seed(SEED)
    return build_model("gpt_tiny", **{"seq_len": 64, **dict(case.overrides)})


def lm_reference(case) -> dict:
    return _one_device(case, _gpt(case), _tokens(case), lambda m, b: token_loss(m(b[0]), b[1]))


def lm_train(case, mesh) -> dict:
    data = _tokens(case)
    return _parallel(case, mesh, _gpt(case), data,
                     first=dict(example_inputs=(data[0][0],), loss_fn=token_loss, example_target=data[0][1]),
                     step=lambda p, b: p.train_step(p.shard_batch(b[0]), target=p.shard_batch(b[1])))


# -- an MLP with a mean-squared error (no token mean: rows weigh) ---------------------------------

class _Blocks(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mse(out, target):
    return (out - target).pow(2).mean()


def _features(case):
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 3, generator=g)) for rows, _ in _plan(case)]


def _mlp(case):
    torch.manual_seed(SEED)
    return _Blocks()


def mse_reference(case) -> dict:
    return _one_device(case, _mlp(case), _features(case), lambda m, b: mse(m(b[0]), b[1]))


def mse_train(case, mesh) -> dict:
    data = _features(case)
    return _parallel(case, mesh, _mlp(case), data,
                     first=dict(example_inputs=(data[0][0],), loss_fn=mse, example_target=data[0][1]),
                     step=lambda p, b: p.train_step(p.shard_batch(b[0]), target=p.shard_batch(b[1])))


# -- a step that must be refused ------------------------------------------------------------------

def refused(case, mesh) -> dict:
    """Compile on the first batch, then run the ``bad`` step: every rank reports autopar's error (or none)."""
    import autopar
    from autopar.errors import AutoparError
    batches = collated(case)
    program = autopar.compile(_hf(case), mesh, example_inputs=batches[0], optimizer=_sgd(case), p2p_timeout_s=60,
                              **dict(case.options))
    program.train_step(program.shard_batch(batches[0]))
    try:
        program.train_step(program.shard_batch(batches[1]))
    except AutoparError as exc:
        return {"kind": type(exc).__name__, "what": exc.what, "where": exc.where, "fix": exc.fix,
                "step_count": program.step_count}
    return {"kind": None, "step_count": program.step_count}
