#!/usr/bin/env bash
# The GPU checks in one go, for a machine with one CUDA GPU or more: the gpu-marked tests, the GPU
# benchmark (autopar's single-stage step vs eager, MFU), then context parallelism against torch's own
# context_parallel (bench/bench_cp_gpu.py: cp = the visible GPUs, one rank each; on one GPU cp=1 of both,
# as NCCL takes one rank per device). Both benchmarks update docs/benchmarks.md.
#   bash bench/gpu_check.sh            (from the repository root; about 8 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -m pytest -q -m gpu tests/on_device -p no:cacheprovider -rs
python bench/bench_gpu.py "$@"
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -gt 1 ]; then
  torchrun --standalone --nproc-per-node "$GPUS" bench/bench_cp_gpu.py
else
  python bench/bench_cp_gpu.py
fi
