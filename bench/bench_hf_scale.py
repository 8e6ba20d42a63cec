"""Plan transformers' Llama-2-70B and Mixtral-8x7B configs, built on the meta device, for 1,024 ranks.

For each config: the library's own model class is built under ``torch.device("meta")`` (no weight
allocated), ``autopar.plan(..., plan="auto")`` chooses a Plan for 1,024 A100-80GB devices (cluster
preset ``a100-80g-8x``, 128 nodes), and one rank's program (rank 0's stage graphs) is built. The
wall and CPU seconds of the whole (build, capture, planner, lowering) are printed with the
1-minute load average; docs/benchmarks.md (section ``hf_scale``) records the lead's quiet-machine run.

    python bench/bench_hf_scale.py                 # both configs
    python bench/bench_hf_scale.py --only llama2_70b --no-docs
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import update_section  # noqa: E402

WORLD = 1024
SEQ = 4096
GLOBAL_BATCH = 1024  # sequences
CONFIGS = {
    "llama2_70b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mixtral_8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        sliding_window=None, rope_theta=1e6)),
}


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def scale(name: str, *, world: int = WORLD, rank: int = 0, seq: int = SEQ, batch: int = GLOBAL_BATCH) -> dict:
    """Build ``name`` on meta, plan it for ``world`` ranks with plan="auto", build rank ``rank``'s program."""
    import transformers

    import autopar
    from autopar.planner import get_cluster

    transformers.logging.set_verbosity_error()
    config_class, model_class, fields = CONFIGS[name]
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    tokens = torch.empty((batch, seq), dtype=torch.long, device="meta")
    built = time.perf_counter() - t0
    result = autopar.plan(model, world, plan="auto", cluster=get_cluster("a100-80g-8x", world=world),
                          example_inputs=(tokens,), loss_fn=_loss, example_target=tokens, ranks=[rank],
                          precision="bf16")
    program = result.rank_program(rank)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(name=name, world=world, rank=rank, wall_s=wall, cpu_s=cpu, build_s=built,
                parameters=sum(p.numel() for p in model.parameters()), plan=result.plan.summary(),
                coords=program.coords, stages=[s.stage for s in program.stages],
                nodes=sum(len(s.gm.graph.nodes) for s in program.stages), load=os.getloadavg()[0],
                still_meta=all(p.is_meta for p in model.parameters()))


def section(results: list[dict]) -> str:
    """The measured rows as the ``hf_scale`` section of docs/benchmarks.md."""
    lines = ["## Hugging Face models on the meta device at 1,024 ranks", "",
             "What is measured: the `transformers` model class built from the published config under "
             "`torch.device(\"meta\")` (no weight allocated), `autopar.plan(model, 1024, plan=\"auto\", "
             "cluster=a100-80g-8x x 128 nodes)` (capture on fake tensors, the planner's search, lowering) and "
             "one rank's program built, in one process, wall and CPU seconds. Target: under 60 s each.", "",
             f"Measured {time.strftime('%c')} (`python bench/bench_hf_scale.py`):", ""]
    for r in results:
        lines += [f"- **{r['name']}** ({r['parameters'] / 1e9:.1f} B parameters) on {r['world']} ranks: "
                  f"{r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU (model built in {r['build_s']:.1f} s; "
                  f"1-minute load {r['load']:.1f}); rank {r['rank']} at {r['coords']} runs stages {r['stages']} "
                  f"({r['nodes']} graph nodes); weights still on meta: {r['still_meta']}.",
                  "", "```text", r["plan"], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", choices=list(CONFIGS), default=None)
    p.add_argument("--world", type=int, default=WORLD)
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = [scale(name, world=args.world) for name in (args.only or list(CONFIGS))]
    text = section(results)
    print(text)
    if not args.no_docs:
        update_section("hf_scale", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
