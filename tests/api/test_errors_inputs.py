"""What a user hands over is checked at the API boundary (autopar/validation.py): the nine mistakes that
used to end in a foreign traceback or a silent success, and their neighbours, each get autopar's error."""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.models import build_model, lm_loss
from autopar.validation import check_state_dict, example_tensors

VOCAB = 128


def _batch(size: int = 8, seq: int = 16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (size, seq), generator=g), torch.randint(0, VOCAB, (size, seq), generator=g)


def _check(info, kind: type, *, what: str, where: str, fix: str):
    err = info.value
    assert type(err) is kind, type(err)
    assert err.what and err.where and err.fix, f"message lacks a part: {err}"
    assert what in err.what, err.what
    assert where in err.where, err.where
    assert fix in err.fix, err.fix


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return build_model("gpt_tiny")


# --- types ------------------------------------------------------------------------------------

@pytest.mark.parametrize("inputs, what", [
    ("some text", "example_inputs must be a tensor, a tuple/list of tensors, or a dict of str -> tensor, got str"),
    (("some text",), "example_inputs[0] is a str, not a tensor"),
    ((np.zeros((8, 16)),), "example_inputs[0] is a numpy.ndarray, not a tensor"),
    (([1, 2, 3],), "example_inputs[0] is a list, not a tensor"),
])
def test_example_inputs_that_are_not_tensors_are_an_input_error(gpt, inputs, what):
    _, y = _batch()
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=inputs, loss_fn=lm_loss, example_target=y)
    _check(info, autopar.InputError, what=what, where="plan(example_inputs=...)", fix="tensor")


def test_a_function_where_a_module_belongs_is_an_input_error():
    x, _ = _batch()
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(lambda t: t * 2, {"dp": 1}, example_inputs=(x,))
    _check(info, autopar.InputError, what="model must be a torch.nn.Module, got function", where="plan(model=...)",
           fix="nn.Module")


def test_a_model_without_parameters_is_an_input_error():
    class Doubler(nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(autopar.InputError) as info:
        autopar.plan(Doubler(), {"dp": 1}, example_inputs=(torch.randn(4, 3),))
    _check(info, autopar.InputError, what="model Doubler has no parameters", where="plan(model=...)",
           fix="nn.Parameter")


def test_a_plan_that_is_not_a_plan_is_an_input_error(gpt):
    x, y = _batch()
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan={"mesh": {}})
    _check(info, autopar.InputError, what="plan must be an autopar.Plan, 'auto' or None, got dict",
           where="plan(plan=...)", fix="model_validate_json")


# --- batches ----------------------------------------------------------------------------------

def test_a_target_batch_of_another_size_is_an_input_error(gpt):
    x, y = _batch()
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=(x,), loss_fn=lm_loss, example_target=y[:4])
    _check(info, autopar.InputError, what="example_target has 4 rows on dim 0 but the example inputs' batch is 8",
           where="plan(example_target=...)", fix="same 8 samples")


def test_inputs_with_different_batch_sizes_are_an_input_error():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, a, b):
            return self.proj(a) + b.sum()

    with pytest.raises(autopar.InputError) as info:
        autopar.plan(TwoInputs(), {"dp": 1}, example_inputs=(torch.randn(8, 4), torch.randn(3, 4)))
    _check(info, autopar.InputError, what="example_inputs[1] has 3 rows on dim 0 but example_inputs[0] has 8",
           where="plan(example_inputs=...)", fix="same batch size")


def test_a_target_without_a_loss_is_an_input_error(gpt):
    x, y = _batch()
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=(x,), example_target=y)
    _check(info, autopar.InputError, what="example_target given without loss_fn", where="plan(example_target=...)",
           fix="loss_fn=")


def test_dict_inputs_and_plain_scalars_among_tensors_are_accepted_by_the_validator():
    x, _ = _batch()
    assert [n for n, _ in example_tensors({"input_ids": x, "attention_mask": x}, where="plan")] == [
        "example_inputs['input_ids']", "example_inputs['attention_mask']"]
    assert [n for n, _ in example_tensors((x, None, 0.5, True), where="plan")] == ["example_inputs[0]"]
    with pytest.raises(autopar.InputError, match=r"example_inputs\['mask'\] is a list, not a tensor"):
        example_tensors({"input_ids": x, "mask": [1, 0]}, where="plan")


# --- the loss ---------------------------------------------------------------------------------

def test_a_loss_that_is_not_a_scalar_is_an_input_error(gpt):
    x, y = _batch()

    def per_token_loss(logits, target):
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")

    with pytest.raises(autopar.InputError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=(x,), loss_fn=per_token_loss, example_target=y)
    _check(info, autopar.InputError, what="loss_fn returned a torch.float32 tensor of shape (64,), not a scalar loss",
           where="loss_fn(output, target)", fix=".mean()")


# --- the Plan against the mesh and the model ---------------------------------------------------

@pytest.fixture(scope="module")
def pp2_plan(gpt):
    x, y = _batch()
    return autopar.plan(gpt, {"pp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y).plan


def test_a_plan_made_for_another_mesh_is_a_plan_error(gpt, pp2_plan):
    x, y = _batch()
    with pytest.raises(autopar.PlanError) as info:
        autopar.plan(gpt, {"dp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=pp2_plan)
    _check(info, autopar.PlanError, what="the Plan was made for mesh dp=1 x pp=2 x tp=1 but the mesh is dp=2 x pp=1",
           where="plan(plan=...)", fix="plan again for dp=2 x pp=1 x tp=1")
    same = autopar.plan(gpt, {"pp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=pp2_plan)
    assert same.plan.mesh == pp2_plan.mesh  # the Plan's own mesh (or none given) still plans


def test_a_plan_made_for_another_model_is_a_plan_error(pp2_plan):
    x, y = _batch()
    bigger = build_model("gpt_tiny", num_layers=4)
    with pytest.raises(autopar.PlanError) as info:
        autopar.plan(bigger, {"pp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=pp2_plan)
    _check(info, autopar.PlanError, what="the Plan was made for a GPT of", where="plan(plan=...)",
           fix="plan this model again")
    with pytest.raises(autopar.PlanError, match="the Plan was made for model GPT, not Llama"):
        autopar.plan(build_model("llama_tiny"), {"pp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                     plan=pp2_plan)




def test_compile_with_a_plan_made_for_another_mesh_is_a_plan_error(one_rank_mesh, gpt, pp2_plan):
    x, y = _batch()
    with pytest.raises(autopar.PlanError) as info:
        autopar.compile(gpt, one_rank_mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=pp2_plan)
    _check(info, autopar.PlanError, what="the Plan was made for mesh dp=1 x pp=2 x tp=1 but the mesh is dp=1 x pp=1",
           where="compile(plan=...)", fix="run on the Plan's mesh")


# --- options without effect ---------------------------------------------------------------------

@pytest.mark.parametrize("mesh, option, why", [
    ({"dp": 2}, {"sequence_parallel": True}, "sequence_parallel=True has no effect on mesh dp=2 x pp=1 x tp=1"),
    ({"tp": 2}, {"sequence_parallel": True, "tensor_parallel": False}, "with tensor_parallel=False"),
    ({"dp": 1}, {"vocab_parallel": True}, "vocab_parallel=True has no effect"),
    ({"pp": 2}, {"pipemare_lr_warmup_updates": 10}, "it tunes the 'pipemare' schedule, not '1f1b'"),
])
def test_an_option_without_effect_on_the_mesh_is_a_plan_error(gpt, mesh, option, why):
    x, y = _batch()
    with pytest.raises(autopar.PlanError) as info:
        autopar.plan(gpt, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, **option)
    name = next(iter(option))
    _check(info, autopar.PlanError, what=why.replace("with tensor_parallel", "tensor_parallel"),
           where=f"plan({name}=", fix=f"drop {name}")


# --- indices past their tables ------------------------------------------------------------------

def test_token_ids_past_the_embedding_are_an_input_error(gpt):
    x, y = _batch()
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(gpt, {"dp": 1}, example_inputs=(x + VOCAB,), loss_fn=lm_loss, example_target=y)
    _check(info, autopar.InputError, what="example input 'idx' holds values", where="input 'idx' indexing tok_emb",
           fix="keep idx in 0..127")
    assert "outside the table's rows 0..127" in info.value.what


class LearnedPositions(nn.Module):
    """Token and learned position embeddings, with no check of its own on the sequence length."""

    def __init__(self, vocab: int = 32, positions: int = 8, hidden: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(positions, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.head(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))


def test_a_sequence_longer_than_the_position_table_is_an_input_error():
    ids = torch.randint(0, 32, (4, 12))
    with pytest.raises(autopar.InputError) as info:
        autopar.plan(LearnedPositions(), {"dp": 1}, example_inputs=(ids,), loss_fn=lm_loss, example_target=ids)
    _check(info, autopar.InputError, what="the index of pos (embedding_1, 8 rows), computed from the example's shapes, "
                                          "holds values 0..11, outside the table's rows 0..7",
           where="lookup embedding_1 (pos)", fix="at most 8")
    fits = torch.randint(0, 32, (4, 8))
    autopar.plan(LearnedPositions(), {"dp": 1}, example_inputs=(fits,), loss_fn=lm_loss, example_target=fits)


# --- init_mesh and checkpoints ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, what", [({"dp": "2"}, "mesh degree dp='2' is a str, not an int"),
                                          ({"tp": 2.0}, "mesh degree tp=2.0 is a float"),
                                          ({"timeout_s": -1}, "timeout_s=-1 is not a positive number")])
def test_init_mesh_arguments_of_the_wrong_kind_are_an_input_error(monkeypatch, kwargs, what):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(autopar.InputError) as info:
        autopar.init_mesh(**kwargs)
    _check(info, autopar.InputError, what=what, where="init_mesh(", fix="pass")
    assert not dist.is_initialized()


@pytest.mark.parametrize("given, what", [(nn.Linear(2, 2), "was given the module Linear, not its state_dict"),
                                         ([torch.ones(2)], "a state_dict must be a mapping of str -> tensor"),
                                         ({"w": [1.0]}, "state_dict entry 'w' is a list")])
def test_a_state_dict_of_the_wrong_kind_is_a_checkpoint_error(given, what):
    with pytest.raises(autopar.CheckpointError) as info:
        check_state_dict(given)
    _check(info, autopar.CheckpointError, what=what, where="load_full_state_dict(state_dict=...)",
           fix="model.state_dict()")


def test_a_checkpoint_path_of_the_wrong_kind_is_a_checkpoint_error(one_rank_mesh):
    x, y = _batch(4)
    program = autopar.compile(build_model("gpt_tiny"), one_rank_mesh, example_inputs=(x,), loss_fn=lm_loss,
                              example_target=y)
    with pytest.raises(autopar.CheckpointError) as info:
        program.load_checkpoint(None)
    _check(info, autopar.CheckpointError, what="a checkpoint path must be a str or os.PathLike, got NoneType",
           where="load_checkpoint(path=...)", fix="save_checkpoint")
    with pytest.raises(autopar.CheckpointError, match="not its state_dict"):
        program.load_full_state_dict(build_model("gpt_tiny"))


def test_the_cli_prints_the_input_error_and_exits_2(capsys):
    from autopar.cli import main
    assert main(["inspect", "plan_fuzz:text_inputs_target", "--mesh", "dp=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar inspect: error: example_inputs[0] is a str, not a tensor"), err
    assert "Where: plan(example_inputs=...)" in err and "Fix: " in err


def test_a_plan_naming_modules_the_model_lacks_is_a_plan_error(gpt):
    """A Plan's tensor-parallel regions and vocabulary-parallel modules used to be dropped silently when the
    model has no such modules (tp=2 without a single shard)."""
    from autopar.plan_model import TpRegionPlan
    x, y = _batch()
    good = autopar.plan(gpt, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y).plan
    again = autopar.plan(gpt, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=good).plan
    assert again.tp_regions == good.tp_regions and again.param_shards == good.param_shards
    edited = good.model_copy(update={"tp_regions": (TpRegionPlan(columns=("attn.qkv",), rows=("attn.proj",)),)})
    with pytest.raises(autopar.PlanError) as info:
        autopar.plan(gpt, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=edited)
    _check(info, autopar.PlanError, what="the Plan's tp_regions names 'attn.qkv', which GPT does not have (1 more)",
           where="plan(plan=...), Plan.tp_regions", fix="named_modules()")
    with pytest.raises(autopar.PlanError, match="the Plan's vocab_parallel names 'embedding'"):
        autopar.plan(gpt, {"tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                     plan=good.model_copy(update={"vocab_parallel": ("embedding",)}))
