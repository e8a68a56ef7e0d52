#!/usr/bin/env bash
# Prebuild the GPU check's extensions on this (CPU) machine, so the GPU machine spends no time on JIT.
#
#   bash gpu_check/prebuild.sh [VENV_DIR]     # default VENV_DIR=<repo>/.venv-cuda
#
# Creates (or reuses) the CUDA torch environment of .ci/cuda_build_check.sh (torch 2.14.1 with CUDA,
# the version requirements/gpu.txt pins for the GPU machine; deepspeed 0.19.8; ninja), adds cuobjdump
# from the nvidia-cuda-cuobjdump wheel when the toolkit has none, and runs
# gpu_check/prebuild_ops.py: the FlashBoB op and the tensor-core probes compiled for sm_80 and
# sm_90 into gpu_check/prebuilt/ (git-ignored; a few MiB: ship it with the check, e.g. as a
# `carry` path of the device run), plus manifest.json and resource_usage.txt, and the cuobjdump
# dump with a header in gpu_check/logs/cuobjdump_resource_usage.txt (committed; render the docs
# table from it with: python gpu_check/resource_table.py --write docs/flashbob.md).
# Takes several minutes on 2 cores (nvcc, 24 kernel instantiations x 2 architectures). Ends with
# `prebuild_ops.py --check`: the loader's own manifest rule says the folder is current for sm_90.
# Exit non-zero when the environment, a build, the dump or that check fails.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-cuda}"
python_bin="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, deepspeed, ninja; assert torch.__version__.startswith('2.14.1'), torch.__version__; assert torch.version.cuda" 2>/dev/null; then
  echo "[prebuild] creating venv $venv"
  "$python_bin" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.14.1" "deepspeed==0.19.8" ninja
fi
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
if ! command -v cuobjdump >/dev/null 2>&1 && ! "$venv/bin/python" -c "import nvidia, pathlib, sys; sys.exit(0 if any(any(pathlib.Path(p).glob('*/bin/cuobjdump')) for p in nvidia.__path__) else 1)" 2>/dev/null; then
  echo "[prebuild] installing cuobjdump (nvidia-cuda-cuobjdump wheel)"
  "$venv/bin/pip" install -q "nvidia-cuda-cuobjdump>=13.2,<14"
fi
cd "$repo"
"$venv/bin/python" gpu_check/prebuild_ops.py --log gpu_check/logs/cuobjdump_resource_usage.txt
exec "$venv/bin/python" gpu_check/prebuild_ops.py --check
