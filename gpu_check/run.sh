#!/usr/bin/env bash
# GPU check: validate and measure ds_ttt's CUDA path in one unattended run (< 10 minutes wall).
#
#   bash gpu_check/run.sh                # results in benchmarks/results/gpu/
#   bash gpu_check/run.sh --out "$OUT"   # e.g. on the lent device machine (docs/gpu.md)
#   bash gpu_check/run.sh --quick        # smoke run (N in {1K, 4K}, T = 2K)
#   bash gpu_check/run.sh --plan         # print phases and time limits, run nothing
#   bash gpu_check/run.sh --help         # every option
#
# Phases (each in its own process with its own time limit), ordered by what they tell: install what
# requirements/gpu.txt provides and the check needs (skipping what is present; from .whl/ when that
# folder holds wheels); load the FlashBoB op (the C-ABI library of gpu_check/prebuild.sh when
# its manifest fits, else JIT; which and how long is recorded); the tensor-core probe against the
# PTX ISA tables with every lane saved; each launcher's kernels alone at N = 96 under
# CUDA_LAUNCH_BLOCKING=1, naming the kernel and its first wrong element; compute-sanitizer memcheck,
# racecheck and synccheck where the image has it (else a recorded skip); pytest tests/ops (a module
# skipped as a whole fails); the FlashBoB CUDA benchmark with per-kernel profiler times at 8K; one
# meta-training step of Qwen3-8B's last pipeline stage with the TTT settings of
# ds_configs/run_qwen3_8b.json at T = 2K / 8K / 16K / 32K (an out-of-memory is a recorded row); the
# real `deepspeed launch/train.py` on the GPU (the shipped configs, one stage, 3 steps at 8K; save +
# --resume when the time holds it); this tree's batched server on a Qwen3-0.6B-shaped model at 1, 8
# and 32 sessions (decode tokens/s, 8 vs 1 and 32 vs 1 against >= 6x and >= 16x); optionally
# (--phases ...,balance) each PP4 stage timed alone.
# Writes environment.json, setup.json, flashbob_cuda.json, last_stage.json, trainer.json,
# serve_concurrency_gpu.json, [pipeline_balance_gpu.json,] summary.md, gpu_check.log (8 files by default).
# Exit 0: every correctness check passed; 1: a check failed; 2: refused (no CUDA GPU visible —
# nothing is written) or bad arguments. Python: $PYTHON (default python3), >= 3.10.
# The work is done by gpu_check/gpu_check.py; see docs/gpu.md.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python_bin="${PYTHON:-python3}"
if ! command -v "$python_bin" >/dev/null 2>&1; then
  echo "gpu_check: refused: no Python interpreter '$python_bin' on PATH (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi
exec "$python_bin" gpu_check/gpu_check.py "$@"
