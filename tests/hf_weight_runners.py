"""Runner kinds for Hugging Face checkpoints in and out (tests/api/test_hf_weights_dist.py).

Each is ``kind="hf_weight_runners:<function>"`` in a :class:`equivalence.Case`; ``case.extra`` names the
pretrained folder (written by the test before spawning) and the folder to save into. The model
each rank builds has other weights than the folder's (equivalence.build's seed): a load that
missed a tensor shows.
"""
from __future__ import annotations

import torch

from equivalence import batches, build, make_optimizer, replica_record


def _inference(case, mesh, model, **extra):
    import autopar
    data = batches(case, model.cfg.vocab_size)
    options = {k: v for k, v in case.options if k != "zero_stage"}
    return autopar.compile(model, mesh, example_inputs=(data[0][0],), p2p_timeout_s=120, **options, **extra), data


def _held_elements(program) -> int:
    from autopar.runtime.state.rank_tensors import held_tensors
    return sum(h.tensor.numel() for h in held_tensors(program))


def pretrained_logits(case, mesh) -> dict:
    """Compile without a loss, load the pretrained folder, the logits of every batch.

    ``extra`` ``meta``: the model is built on the meta device and compiled with the folder as its
    ``weights=`` filler (each rank reads its pieces into a model nobody materialised)."""
    import math
    import autopar.hf
    folder = dict(case.extra)["folder"]
    if dict(case.extra).get("meta"):
        with torch.device("meta"):
            model = build(case)
        fill = autopar.hf.pretrained_weights(folder, model)
        program, data = _inference(case, mesh, model, weights=fill)
        shapes = autopar.hf.folder.PretrainedFolder(folder).shapes
        report = autopar.hf.LoadReport(num_tensors=0, elements_read=fill.elements_read,
                                       checkpoint_elements=sum(math.prod(v) for v in shapes.values()))
    else:
        program, data = _inference(case, mesh, build(case))
        report = autopar.hf.load_pretrained(program, folder)
    outputs = [program(program.shard_batch(x)) for x, _ in data]
    return {"outputs": outputs, "report": report, "held_elements": _held_elements(program),
            "state": program.full_state_dict(), **replica_record(program)}


def train_save(case, mesh) -> dict:
    """Load the pretrained folder into a training program, train, save; then the trained weights'
    logits from an inference program (given them by load_full_state_dict, not by the saved folder)."""
    import autopar
    import autopar.hf
    from autopar.models import lm_loss
    extra = dict(case.extra)
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                              **dict(case.options))
    autopar.hf.load_pretrained(program, extra["folder"])
    loaded = program.full_state_dict()
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data]
    folder = autopar.hf.save_pretrained(program, extra["out"], max_shard_size=extra.get("shard", "5GB"))
    state = program.full_state_dict()
    infer, _ = _inference(case, mesh, build(case))
    infer.load_full_state_dict(state)
    outputs = [infer(infer.shard_batch(x)) for x, _ in data]
    return {"losses": losses, "loaded": loaded, "state": state, "folder": folder, "outputs": outputs,
            **replica_record(program)}


def loaded(case, mesh) -> dict:
    """Load into a training program; its full state. Under bf16 (fp32 masters; ZeRO-1/2: on their
    owners only) also whether every rank's bf16 copies are the masters' rounding."""
    import autopar
    import autopar.hf
    from autopar.models import lm_loss
    model = build(case)
    data = batches(case, model.cfg.vocab_size)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss,
                              example_target=data[0][1], optimizer=make_optimizer(case), p2p_timeout_s=120,
                              **dict(case.options))
    autopar.hf.load_pretrained(program, dict(case.extra)["folder"])
    result = {"state": program.full_state_dict(), **replica_record(program)}
    if program.mixed is not None:  # every rank's own copies: the test reads each rank's answer
        values = dict(program.parameter_values())
        result["rounded"] = all(torch.equal(compute.detach(), values[name].to(compute.dtype))
                                for name, compute, _ in program.mixed.pairs)
        result["compute_dtype"] = str(program.mixed.pairs[0][1].dtype)
    return result


# -- a meta-built Phi-3 with grouped-query attention: its fused qkv_proj sharded in unequal blocks ------------
def _phi3_program(case, mesh):
    """Phi-3 built on the meta device from the pretrained folder's config (4 query heads, 2 kv heads: a fused
    ``[q | k | v]`` whose blocks differ in size), compiled with the folder as its ``weights=`` filler."""
    import transformers
    import autopar
    import autopar.hf
    from hf_runners import logits_loss, token_batches, sgd
    folder = dict(case.extra)["folder"]
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    data = token_batches(case)
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=logits_loss,
                              example_target=data[0][1], optimizer=sgd(case), p2p_timeout_s=120,
                              weights=autopar.hf.pretrained_weights(folder, model), **dict(case.options))
    return model, program, data


def phi3_train_save(case, mesh) -> dict:
    """Load (``weights=``), train the first ``save_after`` steps, save a checkpoint and a Hugging Face folder."""
    import autopar.hf
    from equivalence import replica_record
    extra = dict(case.extra)
    model, program, data = _phi3_program(case, mesh)
    loaded = program.full_state_dict()
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()
              for x, y in data[:extra["save_after"]]]
    program.save_checkpoint(extra["ckpt"])
    folder = autopar.hf.save_pretrained(program, extra["out"])
    return {"losses": losses, "loaded": loaded, "state": program.full_state_dict(), "folder": folder,
            "shards": program.plan.model_dump(mode="json")["param_shards"],
            "still_meta": all(p.is_meta for p in model.parameters()), **replica_record(program)}


def phi3_resume(case, mesh) -> dict:
    """Another mesh loads the checkpoint (resharded) and trains the remaining steps."""
    from equivalence import replica_record
    model, program, data = _phi3_program(case, mesh)
    step = program.load_checkpoint(dict(case.extra)["ckpt"])
    losses = [program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item() for x, y in data[step:]]
    return {"losses": losses, "state": program.full_state_dict(), "step": step, **replica_record(program)}
