"""Memory as a formula (autopar/memory/formula.py, solve.py): equal to the calculator wherever it is evaluated.

The oracle is the memory calculator itself (estimate_memory) on a plan built directly at the size the
formula is evaluated at: the formula must give every rank's bytes of that plan, at sizes it was not
read at, over meshes, schedules, recomputation, precision, ZeRO and models written unlike ours.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.memory import estimate_memory
from autopar.memory.formula import memory_formula
from autopar.memory.solve import largest_microbatch, longest_sequence
from autopar.models import build_model, lm_loss
from tp_families import build_family, logits_loss

SEQ = 16  # the sequence the plans are made at (the formula is read at 8 and checked at other lengths)


def _batch(batch: int, seq: int, vocab: int = 128):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def _model(name: str):
    torch.manual_seed(0)
    if name in ("gpt2", "bloom"):
        return build_family(name), logits_loss
    return build_model(name, seq_len=64), lm_loss


CASES = {  # name: (model, mesh, global batch, options)
    "gpt-pp2-1f1b": ("gpt_tiny", (1, 2, 1), 8, dict(schedule="1f1b", num_microbatches=4)),
    "llama-dp2-pp2-tp2-zbv": ("llama_tiny", (2, 2, 2), 8, dict(schedule="zb_v", num_microbatches=2)),
    "gpt-tp2-sp-full-recompute": ("gpt_tiny", (1, 1, 2), 4, dict(sequence_parallel=True, recompute="full")),
    "llama-dp2-pp2-interleaved-bf16-zero1": ("llama_tiny", (2, 2, 1), 8,
                                             dict(schedule="interleaved_1f1b", num_microbatches=2, precision="bf16",
                                                  zero_stage=1)),
    "gpt-selective-gpipe": ("gpt_tiny", (1, 2, 1), 4, dict(schedule="gpipe", num_microbatches=2,
                                                           recompute="selective")),
    "hf-gpt2-pp2": ("gpt2", (1, 2, 1), 4, dict(num_microbatches=2)),
    "hf-bloom-tp2": ("bloom", (1, 1, 2), 4, {}),
}


def _plan(case: str, *, batch: int | None = None, seq: int = SEQ):
    name, mesh, global_batch, options = CASES[case]
    model, loss = _model(name)
    x, y = _batch(batch or global_batch, seq)
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=loss, example_target=y, **options)


@pytest.mark.parametrize("case", list(CASES))
def test_the_formula_is_the_calculator_at_other_sizes(case):
    result = _plan(case)
    formula = memory_formula(result, optimizer="adam")
    b0 = result.plan.microbatch_size
    assert {r: formula.bytes(r) for r in formula.states} == \
        {r: m.total for r, m in estimate_memory(result, optimizer="adam").ranks.items()}
    mesh, m = result.plan.mesh, result.plan.pipeline.num_microbatches
    b, s = 2 * b0, 24  # a size the formula was not read at (it reads 16 and 8 tokens, b0 to 3 b0)
    other = _plan(case, batch=b * mesh.dp * m, seq=s)
    assert other.plan.pipeline.stage_starts == result.plan.pipeline.stage_starts
    truth = {r: e.total for r, e in estimate_memory(other, optimizer="adam").ranks.items()}
    assert {r: formula.bytes(r, b=b, s=s) for r in truth} == truth


def test_the_longest_sequence_fits_and_one_more_token_does_not():
    """Solved on the formula, checked on the calculator at both lengths (plans made there)."""
    torch.manual_seed(0)
    model = build_model("gpt_tiny", seq_len=512)
    x, y = _batch(4, SEQ)
    result = autopar.plan(model, (1, 2, 1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                          num_microbatches=2)
    formula = memory_formula(result, optimizer="adam")
    capacity = (formula.peak(s=300)[1] + formula.peak(s=301)[1]) // 2 + 17  # between two lengths
    longest = longest_sequence(formula, capacity=capacity)
    assert longest == 300
    for s, fits in ((longest, True), (longest + 1, False)):
        xs, ys = _batch(4, s)
        truth = estimate_memory(autopar.plan(model, (1, 2, 1), example_inputs=(xs,), loss_fn=lm_loss,
                                             example_target=ys, num_microbatches=2), optimizer="adam")
        assert (truth.peak_rank().total <= capacity) is fits, s
    step = longest_sequence(formula, capacity=capacity, step=64)
    assert step == 256  # the multiple of 64 below 300
    b = largest_microbatch(formula, capacity=formula.peak(b=5)[1])
    assert b == 5 and formula.peak(b=6)[1] > formula.peak(b=5)[1]


def test_states_beyond_the_device_fit_no_sequence():
    formula = memory_formula(_plan("gpt-pp2-1f1b"), optimizer="adam")
    capacity = min(formula.states.values()) - 1
    assert longest_sequence(formula, capacity=capacity) == 0
    assert largest_microbatch(formula, capacity=capacity) == 0


class _Padded(nn.Module):
    """Pads the sequence by one position before its head: a saved tensor of s + 1 rows is no monomial."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.head = nn.Linear(16, 128)

    def forward(self, x):
        h = torch.nn.functional.pad(self.emb(x), (0, 0, 0, 1))
        return self.head(torch.tanh(h))[:, :-1]


def test_a_size_that_is_no_product_of_dims_is_refused():
    x, y = _batch(4, SEQ)
    result = autopar.plan(_Padded(), (1, 1, 1), example_inputs=(x,), loss_fn=lm_loss, example_target=y)
    with pytest.raises(autopar.PlanError, match="not a product of batch and sequence dims"):
        memory_formula(result)


@pytest.mark.slow  # Llama 2 7B's shape on the meta device, planned five times per case (minutes)
@pytest.mark.parametrize(("world", "mesh", "optimizer"), [(1, None, "sgd"), (8, "tp=8", "adam")],
                         ids=["one-a100", "eight-a100-tp8"])
def test_max_seq_on_llama_7b_fits_and_one_token_more_does_not(world, mesh, optimizer, capsys):
    """`autopar plan --max-seq` on one A100-80GB preset (SGD: Adam's states alone are 113 GiB) and on 8 with
    tp=8: the length it prints fits by the calculator on a plan made at that length, one token more does not."""
    from autopar.cli import main
    from autopar.models.examples import llama2_7b_meta
    from autopar.plan_model import Plan
    from autopar.planner.cluster import get_cluster
    from autopar.planning import rank_of

    args = ["plan", "autopar.models.examples:llama2_7b_meta", "--cluster", "a100-80g-8x", "--world", str(world),
            "--precision", "bf16", "--optimizer", optimizer, "--max-seq"] + (["--mesh", mesh] if mesh else [])
    assert main(args) == 0
    text = capsys.readouterr().out
    longest = int(re.search(r"longest sequence that fits .* at microbatch 1: (\d+) tokens", text).group(1))
    assert main(args + ["--json"]) == 0
    plan = Plan.model_validate(__import__("json").loads(capsys.readouterr().out)["plan"])
    capacity = get_cluster("a100-80g-8x").usable_bytes(0)
    model, _inputs, loss_fn, _target = llama2_7b_meta()
    for seq, fits in ((longest, True), (longest + 1, False)):
        tokens = torch.zeros((1, seq), dtype=torch.long, device="meta")
        result = autopar.plan(model, plan.mesh, example_inputs=(tokens,), loss_fn=loss_fn, example_target=tokens,
                              plan=plan, ranks=[rank_of(dp=0, pp=q, tp=0, shape=plan.mesh) for q in range(plan.mesh.pp)])
        peak = estimate_memory(result, optimizer=optimizer).peak_rank().total
        assert (peak <= capacity) is fits, (seq, peak, capacity)
