"""Every batch mistake a training loop can make at ``train_step`` gets autopar's error with a fix that works
(docs/batches.md, docs/errors.md), and nothing is stepped; what is no mistake (a shorter sequence, a
partial batch) trains. One rank, one process: the dp-wide refusals are in tests/runtime/test_batches_dist.py.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import build_model, lm_loss
from autopar.runtime.execution.batch_split import microbatch_rows

VOCAB = 128


def _gpt(mesh, *, seq: int = 16, rows: int = 4, **options):
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (rows, seq))
    program = autopar.compile(build_model("gpt_tiny"), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **options)
    return program, x


def _refused(program, x, target=None):
    before = program.step_count
    with pytest.raises(autopar.AutoparError) as info:
        program.train_step(x, target=x if target is None else target)
    assert program.step_count == before
    err = info.value
    assert err.what and err.where and err.fix, f"message lacks a part: {err}"
    return err


def test_a_batch_with_more_rows_than_compiled_is_a_plan_error(one_rank_mesh):
    program, x = _gpt(one_rank_mesh)
    err = _refused(program, torch.cat([x, x[:2]]))
    assert type(err) is autopar.PlanError
    assert "this rank's batch has 6 rows, more than the 4 the program was compiled for" in err.what
    assert "compile on the largest batch" in err.fix and "program.shard_batch" in err.fix


def test_inputs_that_disagree_on_their_rows_are_an_input_error(one_rank_mesh):
    program, x = _gpt(one_rank_mesh)
    err = _refused(program, x, target=x[:3])
    assert type(err) is autopar.InputError
    assert "the batch's inputs disagree on their rows (dim 0): idx 4, target 3" in err.what
    assert "shard_batch" in err.fix


def test_a_sequence_past_the_position_table_is_an_input_error_naming_the_dim(one_rank_mesh):
    program, x = _gpt(one_rank_mesh)  # gpt_tiny's position table: 32 rows
    longer = torch.randint(0, VOCAB, (4, 40))
    err = _refused(program, longer)
    assert type(err) is autopar.InputError
    assert "input 'idx' holds 40 tokens on dim 1 (seq), past the bound 32" in err.what, err.what
    assert "max_length=32" in err.fix and "max_seq_len" in err.fix
    assert program.batching.shapes.num_built == 0  # refused before anything was captured


@pytest.mark.parametrize("mode", ["seq", "auto"])
def test_inputs_that_disagree_on_their_length_are_an_input_error(one_rank_mesh, mode):
    program, x = _gpt(one_rank_mesh, dynamic_shapes=mode)
    err = _refused(program, torch.randint(0, VOCAB, (4, 12)), target=torch.randint(0, VOCAB, (4, 10)))
    assert type(err) is autopar.InputError
    assert "the batch's inputs disagree on seq (dim 1): idx 12, target 10" in err.what, err.what
    assert "pad them to one length together" in err.fix


def test_a_sequence_of_one_token_is_an_input_error(one_rank_mesh):
    program, x = _gpt(one_rank_mesh, dynamic_shapes="seq")
    err = _refused(program, x[:, :1])
    assert type(err) is autopar.InputError and "the program takes 2..32" in err.what
    assert "pad to at least 2" in err.fix


def test_a_max_seq_len_bounds_the_batches(one_rank_mesh):
    program, x = _gpt(one_rank_mesh, dynamic_shapes="seq", max_seq_len=20)
    assert program.plan.max_seq_len == 20 and "seq (dim 1 of idx, target) 2..20 (max_seq_len)" in program.plan.summary()
    err = _refused(program, torch.randint(0, VOCAB, (4, 24)))
    assert "past the bound 20 (max_seq_len)" in err.what
    program.train_step(x[:, :20], target=x[:, :20])


def test_a_max_seq_len_past_the_position_table_is_a_plan_error(one_rank_mesh):
    with pytest.raises(autopar.PlanError) as info:
        _gpt(one_rank_mesh, dynamic_shapes="seq", max_seq_len=64)
    err = info.value
    assert "max_seq_len=64 is past what the model can take: 32" in err.what and "max_seq_len <= 32" in err.fix


def test_an_input_of_another_rank_is_an_input_error(one_rank_mesh):
    program, x = _gpt(one_rank_mesh)
    err = _refused(program, x.unsqueeze(-1))
    assert type(err) is autopar.InputError and "batch input 'idx' has 3 dims" in err.what


def test_a_shorter_sequence_and_a_partial_batch_train(one_rank_mesh):
    program, x = _gpt(one_rank_mesh)
    assert program.train_step(x[:, :9], target=x[:, :9]).isfinite()
    assert program.train_step(x[:3], target=x[:3]).isfinite()  # 2 microbatches of 2 and 1 rows
    assert program.step_count == 2


def test_a_sequence_parallel_length_must_divide_by_tp():
    """Checked per batch; the error names the dim, the length, tp and both fixes (no process group needed)."""
    from autopar.ir.dynamic_shapes import DynamicDim
    from autopar.runtime.execution.shape_cache import check_sizes
    seq = DynamicDim(symbol="s0", inputs=(("input_ids", 1),), low=2, high=64, multiple_of=2)
    check_sizes((seq,), (("input_ids", (4, 18)),), where="rank 0")
    with pytest.raises(autopar.InputError) as info:
        check_sizes((seq,), (("input_ids", (4, 17)),), where="rank 0")
    assert "17 does not divide" in info.value.what and "tp=2" in info.value.what
    assert "pad_to_multiple_of=2" in info.value.fix and "sequence_parallel=False" in info.value.fix


def test_a_partial_batch_the_schedule_cannot_take_names_both_fixes():
    """1F1B on 2 stages needs 2 microbatches: one row cannot make them."""
    assert microbatch_rows(3, size=2, count=4, takes=lambda k: k >= 2) == [2, 1]
    assert microbatch_rows(6, size=2, count=4, takes=lambda k: k >= 2) == [2, 2, 2]
    with pytest.raises(autopar.PlanError) as info:
        microbatch_rows(1, size=2, count=4, takes=lambda k: k >= 2)
    assert "a batch of 1 rows makes 1 microbatches" in info.value.what
    assert "drop_last=True" in info.value.fix and "-100" in info.value.fix and "8 rows" in info.value.fix
