#!/usr/bin/env bash
# GPU check: validate and measure ds_ttt's CUDA path in one unattended run (< 8 minutes wall).
#
#   bash benchmarks/gpu_check.sh                      # results in benchmarks/results/gpu/
#   bash benchmarks/gpu_check.sh --out "$OUT"         # e.g. on the lent device machine (docs/gpu.md)
#   bash benchmarks/gpu_check.sh --quick              # smoke run (N in {1K, 4K}, T = 2K)
#   bash benchmarks/gpu_check.sh --plan               # print phases and time limits, run nothing
#   bash benchmarks/gpu_check.sh --help               # every option
#
# Phases (each with its own time limit): install what requirements/gpu.txt provides and the check
# needs (skipping what is present; from .whl/ when that folder holds wheels), build the FlashBoB
# CUDA op through FlashBoBCUDABuilder, pytest tests/ops, the FlashBoB CUDA benchmark, and one
# meta-training step of a Qwen3-8B-shaped last pipeline stage at T = 2K / 8K / 16K, the real
# `deepspeed launch/train.py` on the GPU (one stage, save + --resume), and each PP4 stage timed alone.
# Writes environment.json, setup.json, flashbob_cuda.json, last_stage.json, trainer.json,
# pipeline_balance_gpu.json, summary.md, gpu_check.log.
# Exit 0: every correctness check passed; 1: a check failed; 2: refused (no CUDA GPU visible —
# nothing is written) or bad arguments. Python: $PYTHON (default python3), >= 3.10.
# The work is done by benchmarks/gpu/gpu_check.py; see docs/gpu.md.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python_bin="${PYTHON:-python3}"
if ! command -v "$python_bin" >/dev/null 2>&1; then
  echo "gpu_check: refused: no Python interpreter '$python_bin' on PATH (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi
exec "$python_bin" benchmarks/gpu/gpu_check.py "$@"
