"""Context parallelism on GPUs: autopar's cp against torch's own ``context_parallel``, side by side.

One rank per visible GPU, and cp = the number of ranks: the sequence of every row is cut over all of them.
Both contenders train their own copy of the same Llama-like model (``autopar.models`` ``llama_tiny`` at
:data:`SHAPE`: 8 layers, hidden 1024, 16 heads over 8 kv heads, SwiGLU 2816, vocab 32000) on the same
rows of :data:`SEQ` tokens with ``lm_loss`` and AdamW(lr=1e-4), TF32 matmuls allowed on both sides, SDPA
restricted to the flash and memory-efficient backends (fp32 takes the efficient one):

- **autopar**: ``autopar.compile`` on the mesh ``dp=1 x cp=N`` (``cp_strategy`` from ``--strategy``); the
  program cuts each row itself (``program.shard_batch`` hands it whole rows).
- **torch**: the plain model under ``torch.distributed.tensor.experimental.context_parallel`` on a 1-D mesh
  of the N ranks (torch 2.13's API, read from its source: ``context_parallel(mesh, *, buffers,
  buffer_seq_dims, no_restore_buffers)`` shards the listed buffers in place on their sequence dims, with the
  head-tail load balancing when the length divides by 2 x N, and routes ``F.scaled_dot_product_attention``
  to its ring over the flash / efficient / cuDNN kernels; forward and backward run inside it). The buffers
  are the tokens, the targets and every layer's rotary ``cos``/``sin`` table (a table as long as the
  sequence, so each rank gets the rows of its positions, as torchtitan passes ``freqs_cis``). Gradients are
  averaged over the N ranks by DDP (each rank's loss is its own tokens' mean; the tokens split evenly).

Per contender: the median step time (steps alternate in rounds, ``bench/_timing.py``, ``cuda.synchronize``
inside the barrier-bracketed step) and the peak memory of a step (``torch.cuda.max_memory_allocated`` over
one step run alone, less what was allocated before it: activations, gradients and workspace; both models
and their optimizer states stay resident throughout and are reported apart).

**One GPU**: NCCL refuses two ranks on one device ("Duplicate GPU detected"), and torch's ring needs NCCL
collectives on CUDA tensors, so cp=2 needs 2 GPUs. On one GPU this compares cp=1 of both (the same harness
and numbers; torch's ``context_parallel`` over a mesh of one rank) and says so in its output.

    torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" bench/bench_cp_gpu.py
    python bench/bench_cp_gpu.py                  # one GPU, a world of one: cp=1 of both
    python bench/bench_cp_gpu.py --dry-run        # no CUDA needed: the configuration, torch's API checked
                                                  # and autopar's cp=2 plan of a small copy of the model
"""
from __future__ import annotations

import argparse
import copy
import inspect
import logging
import os
import sys
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import markdown_rows, run_note, stamped, update_section  # noqa: E402
from _timing import Contender, cuda_synced, measure, ratio_summary  # noqa: E402

__all__ = ["SHAPE", "SEQ", "parse_args", "cp_note", "check_torch_api", "dry_run", "run", "section", "main"]

log = logging.getLogger("bench_cp_gpu")

SHAPE = dict(num_layers=8, hidden=1024, num_heads=16, num_kv_heads=8, intermediate=2816, vocab_size=32000)
SEQ = 16384
BATCH = 1
#: the small copy the dry run plans on the meta device (the same family and head layout)
DRY_SHAPE = dict(num_layers=2, hidden=64, num_heads=16, num_kv_heads=8, intermediate=128, vocab_size=256)
DRY_SEQ = 64
TORCH_CP_PARAMS = ("buffers", "buffer_seq_dims", "no_restore_buffers")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=SEQ, help=f"tokens per row (default {SEQ}); divides by 2 x cp")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"rows per step (default {BATCH})")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"], help="decoder layers (default 8)")
    parser.add_argument("--strategy", default="ring", choices=("ring", "all_to_all", "auto"),
                        help="autopar's cp_strategy (default ring: torch's context_parallel is a ring too)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true",
                        help="no CUDA: print the configuration, check torch's context_parallel API, plan autopar's "
                             "cp=2 program of a small copy on the meta device")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.seq < 2 or args.seq % 2 or args.batch < 1 or args.layers < 1:
        parser.error("--seq must be an even number >= 2, --batch and --layers at least 1")
    return args


def cp_note(world: int, visible_gpus: int) -> str:
    """What cp this run measures, and why (cp = the ranks, one per GPU)."""
    if world == 1:
        return (f"cp=1 of both: {visible_gpus} visible GPU(s), one rank. cp=2 needs 2 GPUs (NCCL refuses two ranks "
                "on one device); run under torchrun with --nproc-per-node 2 or more")
    return f"cp={world}: {world} ranks, one per GPU"


def check_torch_api() -> dict:
    """torch's ``context_parallel`` as this script calls it: its keyword parameters, the rotate method."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    params = inspect.signature(context_parallel).parameters
    missing = [p for p in TORCH_CP_PARAMS if p not in params]
    if missing:
        raise RuntimeError(f"torch {torch.__version__}: context_parallel has no parameter(s) {missing} "
                           f"(has {list(params)}): this script needs updating")
    return {"torch": torch.__version__, "params": list(params), "rotate_method": _cp_options.rotate_method.name,
            "load_balance": _cp_options.enable_load_balance}


def _shape(args, dry: bool = False) -> dict:
    base = DRY_SHAPE if dry else SHAPE
    return {**base, "num_layers": base["num_layers"] if dry else args.layers, "seq_len": DRY_SEQ if dry else args.seq}


def _model(shape: dict, device: str):
    from autopar.models import build_model
    torch.manual_seed(0)
    with torch.device(device):
        return build_model("llama_tiny", **shape)


def rotary_tables(model) -> list[torch.Tensor]:
    """Every attention's rotary ``cos``/``sin`` buffers (sequence on dim 0): what torch's cp must shard."""
    return [t for m in model.modules() if hasattr(m, "cos") and hasattr(m, "sin") for t in (m.cos, m.sin)]


def dry_run(args) -> dict:
    """The configuration, torch's API and autopar's cp=2 plan of a small copy, without CUDA."""
    import autopar
    from autopar.models import lm_loss
    api = check_torch_api()
    shape = _shape(args, dry=True)
    model = _model(shape, "meta")
    x = torch.zeros(2, DRY_SEQ, dtype=torch.long, device="meta")
    result = autopar.plan(model, {"cp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                          cp_strategy=args.strategy)
    attention = [type(m).__name__ for s in result.rank_program(1).stages for m in s.gm.modules()
                 if type(m).__name__ in ("RingAttention", "UlyssesAttention")]
    out = {"api": api, "measured_shape": {**_shape(args), "batch": args.batch},
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "note": cp_note(1, torch.cuda.device_count() if torch.cuda.is_available() else 0),
           "summary": result.plan.summary(), "rank1_attention": attention, "rotary_tables": 2 * shape["num_layers"]}
    print(f"torch {api['torch']}: context_parallel{tuple(api['params'])}, K/V rotate by {api['rotate_method']}")
    print(f"would measure llama_tiny {out['measured_shape']}; {out['note']}")
    print(f"autopar's cp=2 plan of a small copy ({shape}):\n{out['summary']}\nrank 1's attention nodes: {attention}")
    return out


# -- the measured run (CUDA) -----------------------------------------------------------------------
def _init_world() -> tuple[int, int]:
    """(rank, world): torchrun's environment, else a world of one. CPU tensors (the timing's CPU-time sums)
    go over gloo, CUDA tensors over NCCL."""
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        torch.cuda.set_device(0)
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="bench_cp_gpu-"), "store"), 1)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


@contextmanager
def _fused_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        yield


def _data(args, vocab: int, count: int = 4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(vocab, (args.batch, args.seq), generator=g).cuda(),
             torch.randint(vocab, (args.batch, args.seq), generator=g).cuda()) for _ in range(count)]


def _autopar(model, data, cp: int, strategy: str) -> Contender:
    import autopar
    from autopar.models import lm_loss
    mesh = autopar.init_mesh(cp=cp)
    options = {"cp_strategy": strategy} if cp > 1 else {}
    program = autopar.compile(model, mesh, example_inputs=(data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                              optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), num_microbatches=1, **options)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        with _fused_sdpa():
            return program.train_step(program.shard_batch(x), target=program.shard_batch(y)).item()

    return Contender(f"autopar cp={cp} ({strategy if cp > 1 else 'no cp'})", cuda_synced(step))


def _torch(model, data, cp: int) -> Contender:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel
    from autopar.models import lm_loss
    cp_mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
    tables = rotary_tables(model)
    # broadcast_buffers off: each rank's rotary tables hold its own positions inside context_parallel
    wrapped = (DistributedDataParallel(model, process_group=cp_mesh.get_group(), broadcast_buffers=False)
               if cp > 1 else model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int) -> float:
        x, y = (t.clone() for t in data[i % len(data)])  # sharded in place: a fresh copy each step
        opt.zero_grad(set_to_none=True)
        sharded = context_parallel(cp_mesh, buffers=[x, y, *tables], buffer_seq_dims=[1, 1] + [0] * len(tables),
                                   no_restore_buffers={x, y})
        with _fused_sdpa(), sharded:
            loss = lm_loss(wrapped(x), y)
            loss.backward()
        opt.step()
        mean = loss.detach().clone()
        if cp > 1:  # the same tokens on every rank: the mean of the means is the row's mean
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=cp_mesh.get_group())
        return mean.item()

    return Contender(f"torch context_parallel cp={cp}", cuda_synced(step))


def _step_peak(contender: Contender) -> tuple[float, float]:
    """(peak GiB above what was allocated before, absolute peak GiB) of one more step of ``contender``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    contender.step(len(contender.losses))
    peak = torch.cuda.max_memory_allocated()
    return (peak - before) / 2 ** 30, peak / 2 ** 30


def body(args) -> list[dict]:
    rank, world = _init_world()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        if args.seq % (2 * world):
            raise SystemExit(f"bench_cp_gpu: --seq {args.seq} does not divide by 2 x cp = {2 * world}")
        shape = _shape(args)
        data = _data(args, shape["vocab_size"])
        model = _model(shape, "cuda")
        params = sum(p.numel() for p in model.parameters())
        theirs = _torch(copy.deepcopy(model), data, world)
        mine = _autopar(model, data, world, args.strategy)
        resident = torch.cuda.memory_allocated() / 2 ** 30
        for c in (mine, theirs):  # compile, allocator and kernel choice settled before the memory steps
            c.run()
        peaks = {c.name: _step_peak(c) for c in (mine, theirs)}
        ours, peer = measure([mine, theirs], rounds=args.rounds, steps_per_round=args.steps_per_round,
                             warmup=args.warmup)
    finally:
        dist.destroy_process_group()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    r = ratio_summary(ours, peer)
    return [dict(case=f"Llama-like {params / 1e6:.0f}M, {args.batch} x {args.seq} tokens, fp32 (TF32)",
                 cp=world, note=cp_note(world, torch.cuda.device_count()), rank=rank,
                 autopar=ours.name, peer=peer.name, autopar_s=ours.median_s, peer_s=peer.median_s, ratio=r["ratio"],
                 round_iqr=f"{r['round_q1']:.2f}-{r['round_q3']:.2f}",
                 autopar_step_gib=peaks[mine.name][0], peer_step_gib=peaks[theirs.name][0],
                 autopar_peak_gib=peaks[mine.name][1], peer_peak_gib=peaks[theirs.name][1], resident_gib=resident,
                 loss1=f"{ours.first_loss:.5f} / {peer.first_loss:.5f}",
                 loss_last=f"{ours.last_loss:.5f} / {peer.last_loss:.5f}", device=torch.cuda.get_device_name(0))]


def run(args) -> list[dict]:
    return stamped(body, args)


def section(rows: list[dict]) -> str:
    r = rows[0]
    header = ["case", "cp", "autopar s/step", "torch s/step", "autopar / torch", "round IQR",
              "step peak GiB autopar / torch", "losses first (autopar / torch)", "last"]
    cells = [[x["case"], str(x["cp"]), f"{x['autopar_s']:.3f}", f"{x['peer_s']:.3f}", f"{x['ratio']:.3f}",
              x["round_iqr"], f"{x['autopar_step_gib']:.2f} / {x['peer_step_gib']:.2f}", x["loss1"], x["loss_last"]]
             for x in rows]
    return "\n".join([
        "## Context parallelism on GPUs: autopar's cp vs torch's context_parallel",
        "",
        run_note(rows).replace("(2 cores)", f"({r['device']})"),
        "",
        markdown_rows(header, cells),
        "",
        f"{r['note']}. Step peak: `max_memory_allocated` over one step less what was allocated before it; both "
        f"models and their AdamW states ({r['resident_gib']:.1f} GiB) stay resident. Absolute peaks: autopar "
        f"{r['autopar_peak_gib']:.1f} GiB, torch {r['peer_peak_gib']:.1f} GiB (rank {r['rank']}).",
    ])


def main(argv=None) -> list[dict] | dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("bench_cp_gpu: no CUDA device here; nothing measured (--dry-run checks the script on CPU)",
              file=sys.stderr)
        return []
    rows = run(args)
    r = rows[0]
    if r["rank"] == 0:
        print(f"{r['case']}, {r['note']}: autopar / torch {r['ratio']:.3f} (rounds {r['round_iqr']}); step peak "
              f"autopar {r['autopar_step_gib']:.2f} GiB, torch {r['peer_step_gib']:.2f} GiB; losses {r['loss1']}")
        if not args.no_doc:
            update_section("cp_gpu", section(rows))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
