"""Corpus, tokenizer, batches and loss: size, determinism, round trips."""
from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F

from autopar.models import CharTokenizer, TextBatches, corpus_text, lm_loss


def test_corpus_is_large_and_deterministic():
    text = corpus_text()
    assert len(text) >= 200_000
    assert corpus_text() == text
    assert "\t" not in text


@pytest.mark.timing  # wall-clock: skipped by default (tests/conftest.py), run with -m timing
def test_corpus_loads_in_under_a_second():
    start = time.perf_counter()
    corpus_text()
    assert time.perf_counter() - start < 1.0


def test_tokenizer_round_trip_and_fixed_vocab():
    tok = CharTokenizer()
    assert tok.vocab_size == 128
    sample = "def f(x):\n    return {'a': [1, 2]} ~ `x`\n"
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample
    assert tok.decode(torch.tensor(ids)) == sample
    assert max(ids) < tok.vocab_size and min(ids) >= 1
    assert tok.encode("é\t") == [tok.unk_id, tok.unk_id]
    assert CharTokenizer(pad_to_multiple_of=1).vocab_size == 97


def test_corpus_is_almost_all_in_vocabulary():
    tok = CharTokenizer()
    ids = tok.encode_tensor(corpus_text())
    assert (ids == tok.unk_id).float().mean() < 1e-3


def test_batches_shape_shift_and_determinism():
    batches = TextBatches(seq_len=16, batch_size=4, seed=7, num_batches=3)
    first = list(batches)
    assert len(first) == len(batches) == 3
    for inputs, targets in first:
        assert inputs.shape == targets.shape == (4, 16)
        assert inputs.dtype == targets.dtype == torch.long
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
    again = list(TextBatches(seq_len=16, batch_size=4, seed=7, num_batches=3))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    other = next(iter(TextBatches(seq_len=16, batch_size=4, seed=8)))
    assert not torch.equal(first[0][0], other[0])


def test_endless_without_num_batches_and_val_split():
    batches = TextBatches(seq_len=8, batch_size=2, seed=0, split="val")
    assert len(list(itertools.islice(batches, 5))) == 5
    with pytest.raises(TypeError):
        len(batches)
    train = TextBatches(seq_len=8, batch_size=2, seed=0)
    assert len(train.tokens) > 10 * len(batches.tokens)


def test_lm_loss_is_mean_token_cross_entropy():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    expected = torch.stack([F.cross_entropy(logits[b, t:t + 1], targets[b, t:t + 1])
                            for b in range(2) for t in range(5)]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    uniform = lm_loss(torch.zeros(2, 5, 11), targets)
    assert uniform.item() == pytest.approx(math.log(11))
