"""Pretrained weights in: peak resident memory per rank while loading a Hugging Face folder, tp=1 vs tp=2.

The parent writes one ``transformers`` Llama checkpoint (``save_pretrained``, fp32, sharded above
``--shard``) into a temporary folder. Then, for tp in 1 and 2, ``tp`` gloo ranks each build the
model, compile it for inference on mesh (dp=1, pp=1, tp) and call
``autopar.hf.load_pretrained(program, folder)``; each reports

- ``held``: the bytes of the tensors its program holds (its tp shard);
- ``rss before``: resident memory just before the load;
- ``peak in load``: the high-water mark of resident memory during the load alone
  (``/proc/self/clear_refs`` resets it just before; file pages safetensors maps count too);
- ``read``: the checkpoint elements the rank read, of all of them.

``--build cpu`` (the default today) builds the model on the CPU and, once compiled, releases its
weights (``model.to("meta")``: the program keeps its own shard), so the load runs in a rank that
holds only its shard, as a meta-built model's rank does. The process's own peak (``process peak``)
includes building the whole model on the CPU. ``--build meta`` builds it under
``torch.device("meta")`` and gives the folder to compile (``weights=autopar.hf.pretrained_weights``):
each rank's tensors are created from their slices, and ``peak in load`` covers the whole compile,
which reads the folder; ``process peak`` then follows the shard as well. Expect ``peak in load`` at tp=2 about half of tp=1's, less the
interpreter's own memory that both pay. Not a test: memory figures only, no timing.

    python bench/bench_hf_weights.py                     # Llama ~1.1 GB fp32; about 2 minutes
    python bench/bench_hf_weights.py --build meta         # the folder as compile's weights, model on meta
    python bench/bench_hf_weights.py --hidden 128 --layers 2 --vocab 512   # smoke run, seconds
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import machine_line, today, update_section  # noqa: E402
from _spawn import spawn  # noqa: E402

__all__ = ["config_fields", "body", "run", "main"]

MIB = 2 ** 20


def config_fields(args) -> dict:
    """The Llama config of the run (no cache, untied head: the head is sharded like every matrix)."""
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)


def _status() -> dict[str, int]:
    """VmRSS and VmHWM (bytes) of this process."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed blocks otherwise: RSS would not show them gone
    except (OSError, AttributeError):
        pass


def body(rank: int, world: int, folder: str, fields: dict, build: str) -> list[dict]:
    """One rank: build, compile, load; every rank's figures (gathered to rank 0)."""
    import transformers
    import autopar
    import autopar.hf
    from autopar.runtime.state.rank_tensors import held_tensors
    from torch.distributed.device_mesh import init_device_mesh
    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("dp", "pp", "tp"))
    config = transformers.LlamaConfig(**fields)
    with torch.device("meta" if build == "meta" else "cpu"):
        model = transformers.LlamaForCausalLM(config)

    class Logits(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, tokens):
            return self.hf(input_ids=tokens).logits

    example = (torch.zeros(2, 16, dtype=torch.long),)
    if build == "meta":  # the folder is compile's filler: the rank's tensors are created from their slices
        rest = _status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        wrapped = Logits(model)
        fill = autopar.hf.pretrained_weights(folder, wrapped)
        program = autopar.compile(wrapped, mesh, example_inputs=example, weights=fill)
        after = _status()
        held = sum(h.tensor.numel() * h.tensor.element_size() for h in held_tensors(program))
        read, total = fill.elements_read, sum(p.numel() for p in model.parameters())
        before, process_peak = after["VmRSS"], after["VmHWM"]
    else:  # a compiled program (of a model built on the CPU) loads the folder
        program = autopar.compile(Logits(model), mesh, example_inputs=example)
        model.to("meta")  # the program holds its own shard; the model's full weights go
        _release_freed_memory()
        held = sum(h.tensor.numel() * h.tensor.element_size() for h in held_tensors(program))
        before = _status()["VmRSS"]
        process_peak = _status()["VmHWM"]
        rest = before - held
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        report = autopar.hf.load_pretrained(program, folder)
        after = _status()
        read, total = report.elements_read, report.checkpoint_elements
    mine = dict(tp=world, rank=rank, held_mib=held / MIB, rss_before_mib=before / MIB, rest_mib=rest / MIB,
                load_peak_mib=after["VmHWM"] / MIB, process_peak_mib=max(process_peak, after["VmHWM"]) / MIB,
                read=read, total=total)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return every


def run(args) -> list[dict]:
    import transformers
    transformers.logging.set_verbosity_error()
    fields = config_fields(args)
    root = tempfile.mkdtemp(prefix="bench-hf-weights-")
    try:
        folder = os.path.join(root, "llama")
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).save_pretrained(folder,
                                                                                        max_shard_size=args.shard)
        rows = []
        for tp in (1, 2):
            rows += spawn(body, world_size=tp, args=(folder, fields, args.build), timeout_s=1800)
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(rows: list[dict]) -> str:
    head = ("| tp | rank | held MiB | rss before MiB | peak in load MiB | peak in load less the rest MiB | "
            "process peak MiB | elements read |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        r["weights_peak_mib"] = r["load_peak_mib"] - r["rest_mib"]
        lines.append(f"| {r['tp']} | {r['rank']} | {r['held_mib']:.0f} | {r['rss_before_mib']:.0f} | "
                     f"{r['load_peak_mib']:.0f} | {r['weights_peak_mib']:.0f} | {r['process_peak_mib']:.0f} | "
                     f"{r['read']:,} of {r['total']:,} |")
    ratios = []
    for key, label in (("load_peak_mib", "peak in load"), ("weights_peak_mib", "peak in load less the rest")):
        one = next(r[key] for r in rows if r["tp"] == 1)
        two = max(r[key] for r in rows if r["tp"] == 2)
        ratios.append(f"{label}, tp=2 / tp=1: {two / one:.2f}")
    return ("\n".join(lines) + "\n\n" + "; ".join(ratios) + " (the larger tp=2 rank). \"The rest\" is what a rank "
            "holds besides its weights (the interpreter, torch, transformers): with --build cpu, rss before the load "
            "less the weights held; with --build meta, rss before compile (the peak then covers compile, which reads "
            "the folder).")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard", default="500MB", help="max_shard_size of the checkpoint's files")
    parser.add_argument("--build", choices=("cpu", "meta"), default="cpu")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    rows = run(args)
    text = (f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, built on {args.build}; "
            f"{today()}; {machine_line()}; 1-minute load {load:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
            + table(rows))
    print(text)
    if args.write_docs:
        how = "into a meta-built model at compile" if args.build == "meta" else "into a compiled program"
        update_section(f"hf_weights_{args.build}", f"## Pretrained weights in, {how}: peak memory per rank "
                       f"(bench/bench_hf_weights.py --build {args.build})\n\n" + text)


if __name__ == "__main__":
    main()
