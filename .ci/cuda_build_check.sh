#!/usr/bin/env bash
# CUDA compile check for the FlashBoB op (no GPU needed; the kernels are built and imported, not run).
#
#   bash .ci/cuda_build_check.sh [VENV_DIR]        # default VENV_DIR=<repo>/.venv-cuda
#
# Creates (or reuses) a separate virtual environment with the CUDA 13.0 build of torch 2.14.1
# (from the local wheel store, ~5.5 GB), deepspeed 0.19.8 and ninja, then JIT-builds the CUDA op
# through ds_ttt.ops.flashbob.builder.FlashBoBCUDABuilder with CUDA_HOME=/usr/local/cuda and
# TORCH_CUDA_ARCH_LIST=FlashBoBCUDABuilder.ARCH_LIST (sm_80 and sm_90), and imports the resulting
# extension. Then it compiles the kernel source to PTX for each of those archs (nvcc -ptx, the
# builder's own nvcc flags), splits the PTX by kernel entry and requires every forward, first-
# backward and backward-over-backward entry compiled for that arch to contain tensor-core MMA
# (mma.sync.aligned.m16n8k16), and every (kernel, bf16/fp16, head dim 64/128) to have at least one
# such entry; entries of tile shapes built for a later arch (Tiles<..., ARCH> in the mangled name,
# e.g. the sm90 tile set in sm_80 PTX) must be stubs (a trap, no mma). It prints mma/ldmatrix/
# cp.async counts and the tile shape of each entry. Exits non-zero when a kernel does not compile
# or link, or when a compiled entry has no mma.sync, a stub has one, or a combination is missing. The build cache lives in <repo>/.torch_extensions/cuda-check (wiped first so the
# check always compiles). Prints how long each phase took.
# FLASHBOB_PTX_CHECK_ONLY=file.ptx runs only the per-entry PTX check on that file (to show the
# check fails on PTX without tensor-core MMA, e.g. the CUDA-core kernels of git history).
# Extra nvcc flags: DS_TTT_FLASHBOB_NVCC_FLAGS (e.g. "-Xptxas=-v" for register/spill counts;
# "-DFLASHBOB_FORCE_COMPILE_ERROR" makes the kernel fail to compile, to prove this exits non-zero).
set -euo pipefail
start=$(date +%s)
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Per-entry PTX check: every kernel family has compiled entries for bf16/fp16 x D 64/128, each using mma.sync.
check_ptx() {  # check_ptx FILE.ptx LABEL
  python3 - "$1" "$2" <<'PY'
import re, sys
path, label = sys.argv[1], sys.argv[2]
text = open(path).read()
# ".visible .entry NAME(" / ".entry NAME(" starts a kernel; its body runs to the next entry.
starts = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+(\S+?)\s*\(", text, re.M)]
bodies = {name: text[a:(starts[i + 1][0] if i + 1 < len(starts) else len(text))]
          for i, (a, name) in enumerate(starts)}
families = ["fwd_kernel", "bwd_row_kernel", "bwd_col_kernel", "bob_stats_kernel",
            "bob_row_kernel", "bob_col_kernel"]
target = re.search(r"^\s*\.target\s+sm_(\d+)", text, re.M)
arch = int(target.group(1)) * 10 if target else 0  # sm_80 -> 800, as __CUDA_ARCH__
failures, compiled, stubs = [], 0, 0
for fam in families:
    tag = f"{len(fam)}{fam}"  # Itanium-mangled identifier, e.g. 10fwd_kernel
    entries = {n: b for n, b in bodies.items() if tag in n}
    have = set()
    for n, b in sorted(entries.items()):
        mma = len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16\b", b))
        ldm = len(re.findall(r"\bldmatrix\.sync\.aligned\b", b))
        cpa = len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global\b", b))
        dt = "bf16" if "nv_bfloat16" in n else "fp16"
        d = re.search(r"Li(64|128)E", n)
        t = re.search(r"TilesILi(\d+)ELi(\d+)ELi(\d+)E(?:Li(\d+)E)?", n)
        shape = "/".join(t.groups()[:3]) if t else "?"
        shape_arch = int(t.group(4) or 800) if t else 800
        stub = shape_arch > arch
        print(f"[cuda_build_check] {label} {fam:17s} {dt} D={d.group(1) if d else '?':3s} {shape:9s} "
              + (f"stub (built for sm_{shape_arch // 10}+)" if stub else
                 f"mma.sync {mma:5d}  ldmatrix {ldm:4d}  cp.async {cpa:3d}"))
        if stub:
            stubs += 1
            if mma or not re.search(r"\btrap;", b):
                failures.append(f"{fam} ({n}): a tile shape for sm_{shape_arch // 10}+ must be a trap stub here")
            continue
        compiled += 1
        have.add((dt, d.group(1) if d else "?"))
        if mma == 0:
            failures.append(f"{fam} ({n}): no mma.sync in its PTX")
    for dt in ("bf16", "fp16"):
        for D in ("64", "128"):
            if (dt, D) not in have:
                failures.append(f"{fam}: no compiled PTX entry for {dt} D={D}")
if failures:
    print(f"[cuda_build_check] FAIL ({label} PTX {path}):", *failures, sep="\n    ")
    raise SystemExit(1)
print(f"[cuda_build_check] {label}: tensor-core MMA in all {compiled} compiled kernel entries "
      f"({stubs} stubs of tile shapes for later architectures)")
PY
}

if [ -n "${FLASHBOB_PTX_CHECK_ONLY:-}" ]; then
  check_ptx "$FLASHBOB_PTX_CHECK_ONLY" "$(basename "$FLASHBOB_PTX_CHECK_ONLY")"
  exit 0
fi
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
arch_list="$(cd "$repo" && "$venv/bin/python" -c 'from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder as B; print(B.ARCH_LIST)' 2>/dev/null | tail -1)"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch_list}"
echo "[cuda_build_check] TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
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
t_build=$(date +%s)

# PTX per arch, with the builder's own nvcc flags (the .cu is torch-free, so no torch includes).
ptx_dir="$TORCH_EXTENSIONS_DIR/ptx"
mkdir -p "$ptx_dir"
read -r -a nvcc_flags <<< "$("$venv/bin/python" -c 'from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder as B; print(" ".join(B().nvcc_args()))' 2>/dev/null | tail -1)"
csrc="$repo/ds_ttt/ops/flashbob/csrc"
for arch in ${TORCH_CUDA_ARCH_LIST//;/ }; do
  sm="${arch%%+*}"
  sm="${sm/./}"
  out="$ptx_dir/flashbob_cuda_kernel.sm_$sm.ptx"
  "$CUDA_HOME/bin/nvcc" -ptx -arch="compute_$sm" "${nvcc_flags[@]}" -I"$csrc" \
    "$csrc/flashbob_cuda_kernel.cu" -o "$out"
  check_ptx "$out" "sm_$sm"
done
end=$(date +%s)
echo "[cuda_build_check] OK: total $((end - start)) s (env $((t_env - start)) s, build $((t_build - t_env)) s, PTX check $((end - t_build)) s)"
