#!/usr/bin/env bash
# The GPU checks in one go, for a machine with one CUDA GPU: the gpu-marked tests, then the GPU
# benchmark (autopar's single-stage step vs eager, MFU), which updates docs/benchmarks.md.
#   bash bench/gpu_check.sh            (from the repository root; about 5 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -m pytest -q -m gpu tests/on_device -p no:cacheprovider -rs
python bench/bench_gpu.py "$@"
