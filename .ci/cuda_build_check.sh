#!/usr/bin/env bash
# CUDA compile check for the FlashBoB op (no GPU needed; the kernels are built and imported, not run).
#
#   bash .ci/cuda_build_check.sh [VENV_DIR]        # default VENV_DIR=<repo>/.venv-cuda
#
# Creates (or reuses) a separate virtual environment with the CUDA 13.0 build of torch 2.14.1
# (from the local wheel store, ~5.5 GB), deepspeed 0.19.8 and ninja, then JIT-builds the CUDA op
# through ds_ttt.ops.flashbob.builder.FlashBoBCUDABuilder with CUDA_HOME=/usr/local/cuda and
# TORCH_CUDA_ARCH_LIST=9.0, and imports the resulting extension. Exits non-zero when the kernels
# do not compile or link. The build cache lives in <repo>/.torch_extensions/cuda-check (wiped
# first so the check always compiles). Prints how long each phase took.
# Extra nvcc flags: DS_TTT_FLASHBOB_NVCC_FLAGS (e.g. "-Xptxas=-v" for register/spill counts;
# "-DFLASHBOB_FORCE_COMPILE_ERROR" makes the kernel fail to compile, to prove this exits non-zero).
set -euo pipefail
start=$(date +%s)
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-cuda}"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, deepspeed, ninja; assert torch.__version__.startswith('2.14.1'), torch.__version__; assert torch.version.cuda" 2>/dev/null; then
  echo "[cuda_build_check] creating venv $venv"
  "$python_bin" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.14.1" "deepspeed==0.19.8" ninja
fi
t_env=$(date +%s)
echo "[cuda_build_check] venv ready in $((t_env - start)) s: $("$venv/bin/python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export TORCH_EXTENSIONS_DIR="$repo/.torch_extensions/cuda-check"
export DS_BUILD_OPS=0
rm -rf "$TORCH_EXTENSIONS_DIR"
mkdir -p "$TORCH_EXTENSIONS_DIR"

cd "$repo"
"$venv/bin/python" - <<'PY'
import time
t0 = time.time()
from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder
b = FlashBoBCUDABuilder()
print("[cuda_build_check] sources:", *b.sources(), sep="\n    ")
ok = b.is_compatible(verbose=True)
print("[cuda_build_check] is_compatible:", ok, "-", b.incompatible_reason or "ok")
if not ok:
    raise SystemExit("[cuda_build_check] FAIL: builder reports incompatible: " + b.incompatible_reason)
mod = b.load(verbose=False)  # JIT compile + link + import (the kernels are not run: no GPU)
names = [n for n in ("fwd", "bwd", "bwd_bwd") if hasattr(mod, n)]
assert names == ["fwd", "bwd", "bwd_bwd"], f"extension is missing entry points: {dir(mod)}"
print(f"[cuda_build_check] built and imported {mod.__name__} ({', '.join(names)}) "
      f"in {time.time() - t0:.1f} s")
PY
end=$(date +%s)
echo "[cuda_build_check] OK: total $((end - start)) s (env $((t_env - start)) s, build $((end - t_env)) s)"
