"""GPT-2 at tp=2: autopar against DTensor with the best hand plan a user can write for ``Conv1D``.

Both contenders train transformers' own ``GPT2LMHeadModel`` (dropout off, no cache) from the same
weights on the same token batches, with a cross entropy on its logits and AdamW(lr=1e-3):

- autopar: ``autopar.compile`` on a (dp=1, pp=1, tp=2) mesh, ``num_microbatches=1`` and
  ``vocab_parallel=False`` (the peer shards only the blocks too). Its plan comes from the graph;
  the share of GPT-2's >= 2-D weights it shards is reported next to the ratio (0 where autopar
  does not yet shard ``Conv1D``'s ``addmm``: then the "ratio" is a replicated model's).
- peer: ``parallelize_module`` per block with ``ColwiseParallel``/``RowwiseParallel`` subclassed
  for ``Conv1D`` (torch's styles take only ``nn.Linear``/``nn.Embedding``): ``Conv1D`` computes
  ``addmm(bias, x, weight)`` with an (in, out) weight, so a column shard is ``Shard(1)`` of the
  weight and ``Shard(0)`` of the bias, a row shard ``Shard(0)`` of the weight with the bias
  replicated. The fused ``c_attn`` [q | k | v] is first permuted column-wise into per-rank blocks
  [q_r k_r v_r] (a contiguous ``Shard(1)`` would hand rank 0 all of q and half of k) and each
  attention's ``split_size``/``num_heads`` set to its per-rank values.

    python bench/bench_tp_gpt2.py                       # timing run: prints a table, updates docs
    python bench/bench_tp_gpt2.py --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 \\
        --rounds 2 --warmup 1 --no-doc                  # smoke run
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from _setup import adamw
from _report import console_table, markdown_table, run_note, stamped, update_section
from _spawn import spawn
from _timing import DEFAULTS, Contender, measure, row_cells

__all__ = ["parallelize_gpt2", "run", "section", "main"]

SEED = 0
VOCAB = 128
NUM_BATCHES = 4
#: The timed setting (GPT-like, as bench_tensor_parallel's): the CLI's defaults.
CONFIG = dict(layers=8, hidden=256, heads=8, seq=64, batch=32)


def _styles():
    """ColwiseParallel / RowwiseParallel written for Conv1D's (in, out) weight."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def _shard(module, mesh, placements: dict):
        for name, param in list(module.named_parameters()):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placements[name]]),
                                                         requires_grad=param.requires_grad))

    class ColwiseConv1D(ColwiseParallel):
        """Column-parallel Conv1D: weight (in, out) on Shard(1), bias on Shard(0); input replicated."""

        def _apply(self, module, device_mesh):
            return distribute_module(
                module, device_mesh, lambda _n, m, mesh: _shard(m, mesh, {"weight": Shard(1), "bias": Shard(0)}),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class RowwiseConv1D(RowwiseParallel):
        """Row-parallel Conv1D: weight (in, out) on Shard(0), bias replicated; input sharded on its last dim."""

        def _apply(self, module, device_mesh):
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module, device_mesh, lambda _n, m, mesh: _shard(m, mesh, {"weight": Shard(0), "bias": Replicate()}),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return ColwiseConv1D, RowwiseConv1D


def _per_rank_qkv(attn, tp: int) -> None:
    """Permute c_attn's output columns from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    hidden = attn.embed_dim
    index = torch.cat([torch.arange(i * hidden, (i + 1) * hidden).chunk(tp)[r] for r in range(tp) for i in range(3)])
    with torch.no_grad():
        attn.c_attn.weight.copy_(attn.c_attn.weight[:, index])
        attn.c_attn.bias.copy_(attn.c_attn.bias[index])


def parallelize_gpt2(model: nn.Module, tp_mesh) -> nn.Module:
    """The hand plan: per block c_attn/c_fc column-parallel, both c_proj row-parallel, per-rank heads."""
    from torch.distributed.tensor.parallel import parallelize_module
    colwise, rowwise = _styles()
    tp = tp_mesh.size()
    for block in model.transformer.h:
        _per_rank_qkv(block.attn, tp)
        parallelize_module(block, tp_mesh, {"attn.c_attn": colwise(), "attn.c_proj": rowwise(),
                                            "mlp.c_fc": colwise(), "mlp.c_proj": rowwise()})
        block.attn.split_size //= tp
        block.attn.num_heads //= tp
    return model


def _loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _build(cfg: dict) -> nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=cfg["seq"], n_embd=cfg["hidden"],
                                     n_layer=cfg["layers"], n_head=cfg["heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(SEED)
    return transformers.GPT2LMHeadModel(config)


def _data(cfg: dict):
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"]), generator=g),
             torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"]), generator=g)) for _ in range(NUM_BATCHES)]


def _share(model: nn.Module, shards) -> float:
    weights = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2}
    return sum(v for n, v in weights.items() if n in shards) / sum(weights.values())


def _autopar(model: nn.Module, data):
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    t0 = time.perf_counter()
    program = autopar.compile(copy.deepcopy(model), mesh, example_inputs=(data[0][0],), loss_fn=_loss,
                              example_target=data[0][1], optimizer=adamw, num_microbatches=1, vocab_parallel=False)
    program.compile_s = time.perf_counter() - t0

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender("autopar tp=2", step), program


def _peer(model: nn.Module, data) -> Contender:
    from torch.distributed.device_mesh import init_device_mesh
    peer = parallelize_gpt2(copy.deepcopy(model), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    opt = adamw(list(peer.parameters()))

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss = _loss(peer(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return Contender("DTensor Conv1D hand plan", step)


def body(rank: int, world: int, cfg: dict, rounds: int, steps_per_round: int, warmup: int) -> list[dict]:
    """Every rank: build both contenders from the same weights and time them, interleaved."""
    assert world == 2, "the GPT-2 tensor-parallel benchmark runs on 2 ranks"
    data = _data(cfg)
    model = _build(cfg)
    ap, program = _autopar(model, data)
    peer = _peer(model, data)
    mine, theirs = measure([ap, peer], rounds=rounds, steps_per_round=steps_per_round, warmup=warmup)
    case = f"GPT-2 {cfg['layers']}x{cfg['hidden']} tp=2"
    return [dict(case=case, **row_cells(mine, theirs), compile_s=program.compile_s,
                 share=_share(model, program.plan.param_shards))]


def run(cfg: dict | None = None, *, rounds: int = DEFAULTS["rounds"],
        steps_per_round: int = DEFAULTS["steps_per_round"], warmup: int = DEFAULTS["warmup"]) -> list[dict]:
    """Spawn 2 gloo ranks, run the benchmark, return rank 0's rows (stamped with date and load)."""
    cfg = dict(CONFIG if cfg is None else cfg)
    return stamped(spawn, body, world_size=2, args=(cfg, rounds, steps_per_round, warmup), timeout_s=900)


def section(rows: list[dict], cfg: dict | None = None) -> str:
    """This benchmark's part of docs/benchmarks.md."""
    cfg = CONFIG if cfg is None else cfg
    return "\n".join([
        "## Tensor parallelism on GPT-2 (Conv1D): autopar tp=2 vs DTensor with a hand plan",
        "",
        run_note(rows),
        "",
        f"Model: transformers' `GPT2LMHeadModel`, {cfg['layers']} layers, width {cfg['hidden']}, {cfg['heads']} heads, "
        f"sequence {cfg['seq']}, vocab {VOCAB}, dropout off. Batch {cfg['batch']}, cross entropy on the logits, "
        "AdamW(lr=1e-3), 1 microbatch, blocks only on both sides (autopar `vocab_parallel=False`).",
        "Peer: `ColwiseParallel`/`RowwiseParallel` subclassed for `Conv1D` (weight (in, out): column = weight "
        "`Shard(1)` + bias `Shard(0)`, row = weight `Shard(0)` + bias replicated) on c_attn, c_fc / both c_proj, "
        "c_attn's columns permuted into per-rank [q k v] blocks, per-rank `split_size` and `num_heads`.",
        "",
        markdown_table(rows),
        "",
        "Share of GPT-2's >= 2-D weights autopar sharded: " + ", ".join(f"{r['share']:.1%}" for r in rows)
        + "; compile time (not in the step times): " + ", ".join(f"{r['compile_s']:.1f} s" for r in rows) + ".",
    ])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=CONFIG["layers"])
    parser.add_argument("--hidden", type=int, default=CONFIG["hidden"])
    parser.add_argument("--heads", type=int, default=CONFIG["heads"])
    parser.add_argument("--seq", type=int, default=CONFIG["seq"])
    parser.add_argument("--batch", type=int, default=CONFIG["batch"])
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"])
    parser.add_argument("--steps-per-round", type=int, default=DEFAULTS["steps_per_round"])
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    cfg = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch)
    rows = run(cfg, rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup)
    print(console_table(rows))
    print("autopar sharded " + ", ".join(f"{r['share']:.1%}" for r in rows) + " of GPT-2's >= 2-D weights")
    if not args.no_doc:
        update_section("tp_gpt2", section(rows, cfg))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
