"""Compile the GPU check's extensions here (no GPU needed) so the device machine does no JIT.

    .venv-cuda/bin/python gpu_check/prebuild_ops.py [--out gpu_check/prebuilt] [--log FILE]
    # normally through: bash gpu_check/prebuild.sh   (sets up .venv-cuda and cuobjdump first)
    .venv/bin/python gpu_check/prebuild_ops.py --check [--out DIR] [--capability 9.0]
    # is DIR current? the loader's own rule (builder.prebuilt_mismatch) for the GPU modules; exit 0 yes, 1 no

Needs CUDA_HOME with nvcc (the toolkit version the GPU machine has), cuobjdump (on PATH, under
$CUDA_HOME/bin, or from the nvidia-cuda-cuobjdump wheel) and, for the emulated probe only, a torch
(the CUDA build requirements/gpu.txt pins). Builds for FlashBoBCUDABuilder.ARCH_LIST (sm_80, sm_90)
with the builder's own nvcc flags:

    libflashbob_cuda.so    nvcc -shared of flashbob_cuda_kernel.cu + mma_probe.cu + the C ABI
                           (csrc/flashbob_capi.cpp), cudart static: no torch headers, so it loads
                           with any torch and Python (ds_ttt/ops/flashbob/capi.py, ctypes); it
                           serves both ds_ttt_flashbob_cuda (the op) and ds_ttt_mma_probe_cuda
    ds_ttt_mma_probe_emu.so the probe through the CPU emulator (MmaProbeEmuBuilder, a torch
                           extension: used only where torch and Python equal this build's), which
                           tests/ops/test_mma_probe_cuda.py compares against

and writes into --out (git-ignored): those files, manifest.json (CUDA / nvcc / torch / Python
versions, arch list, nvcc flags, sha256 of every kernel source, seconds per module) and
resource_usage.txt, the output of `cuobjdump --dump-resource-usage` on the GPU library
(registers, stack, local and static shared memory of every kernel per architecture). --log also
copies that dump, with a header naming the build, to a file meant to be committed
(gpu_check/logs/cuobjdump_resource_usage.txt), from which gpu_check/resource_table.py
generates the table in docs/flashbob.md.

On the GPU machine ds_ttt.ops.flashbob.builder.load_with_prebuilt imports these when the manifest
matches there (same torch and Python, sources unchanged, a GPU of sm_8x or sm_90) and JIT-builds
otherwise; the GPU check records which path it took. Exit 0 on success, 1 when a build or the
dump failed (the message says which and why).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "gpu_check" / "prebuilt"


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, in $CUDA_HOME/bin, or inside the nvidia-cuda-cuobjdump wheel."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if Path(cuda_home, "bin", "cuobjdump").exists():
        return str(Path(cuda_home, "bin", "cuobjdump"))
    try:
        import nvidia  # the namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for hit in sorted(Path(root).glob("*/bin/cuobjdump")):
            return str(hit)
    return None


def nvcc_version(cuda_home: str) -> str:
    out = subprocess.run([str(Path(cuda_home, "bin", "nvcc")), "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def gencode(arch_list: str) -> list[str]:
    """'8.0;9.0' -> -gencode flags for cubins only (what torch's JIT emits for that list)."""
    flags = []
    for a in arch_list.replace(",", ";").split(";"):
        sm = a.strip().split("+")[0].replace(".", "")
        if sm:
            flags += ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
    return flags


def build_capi(out: Path, arch_list: str, nvcc_args: list[str], cuda_home: str) -> dict:
    """The C-ABI GPU library with one nvcc call; {file, seconds, bytes}."""
    from ds_ttt.ops.flashbob.builder import CSRC

    target = out / "libflashbob_cuda.so"
    cmd = [str(Path(cuda_home, "bin", "nvcc")), "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "--threads", "2",
           *nvcc_args, *gencode(arch_list), f"-I{CSRC}", str(CSRC / "flashbob_cuda_kernel.cu"), str(CSRC / "mma_probe.cu"),
           str(CSRC / "flashbob_capi.cpp"), "-o", str(target)]
    print(f"[prebuild] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"prebuild: nvcc failed building {target.name}:\n{(r.stdout + r.stderr)[-4000:]}")
    seconds = round(time.perf_counter() - t0, 1)
    print(f"[prebuild] {target} ({target.stat().st_size / 2**20:.1f} MiB, {seconds} s)", flush=True)
    return {"file": target.name, "seconds": seconds, "bytes": target.stat().st_size}


def build_all(out: Path) -> dict:
    import torch
    from torch.utils import cpp_extension

    from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder, sources_digest
    from ds_ttt.ops.flashbob.probe_builder import MmaProbeEmuBuilder

    cuda_home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME or "/usr/local/cuda"
    if not Path(cuda_home, "bin", "nvcc").exists():
        raise SystemExit(f"prebuild: no nvcc under CUDA_HOME={cuda_home} (set CUDA_HOME to the CUDA toolkit)")
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or FlashBoBCUDABuilder.ARCH_LIST
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    os.environ["DS_BUILD_OPS"] = "0"
    digest_before = sources_digest()
    nvcc_args = FlashBoBCUDABuilder().nvcc_args()
    manifest = {"built_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                "python": "%d.%d" % sys.version_info[:2], "arch_list": arch_list, "cuda_home": cuda_home,
                "nvcc": nvcc_version(cuda_home), "nvcc_args": nvcc_args, "sources_sha256": digest_before, "modules": {}}
    out.mkdir(parents=True, exist_ok=True)
    lib = build_capi(out, arch_list, nvcc_args, cuda_home)
    for name in ("ds_ttt_flashbob_cuda", "ds_ttt_mma_probe_cuda"):
        manifest["modules"][name] = {**lib, "abi": "c", "gpu": True}
    with tempfile.TemporaryDirectory(prefix="flashbob-prebuild.") as ext_dir:
        os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
        builder = MmaProbeEmuBuilder()
        t0 = time.perf_counter()
        print(f"[prebuild] building {builder.NAME} (CPU, torch {torch.__version__}) ...", flush=True)
        module = builder.load(verbose=False)
        target = out / f"{builder.NAME}.so"
        shutil.copy2(Path(module.__file__), target)
        manifest["modules"][builder.NAME] = {"file": target.name, "abi": "torch", "gpu": False,
                                             "bytes": target.stat().st_size,
                                             "seconds": round(time.perf_counter() - t0, 1)}
        print(f"[prebuild] {builder.NAME}: {target}", flush=True)
    if sources_digest() != digest_before:
        raise SystemExit("prebuild: the kernel sources changed during the build; run it again")
    return manifest


def dump_resource_usage(out: Path, manifest: dict) -> str:
    exe = find_cuobjdump()
    if exe is None:
        raise SystemExit("prebuild: no cuobjdump (not on PATH, not in $CUDA_HOME/bin, no nvidia-cuda-cuobjdump "
                         "wheel): pip install nvidia-cuda-cuobjdump (bash gpu_check/prebuild.sh does)")
    parts = []
    files = list(dict.fromkeys(e["file"] for e in manifest["modules"].values() if e["gpu"]))
    for f in files:
        entry = {"file": f}
        r = subprocess.run([exe, "--dump-resource-usage", str(out / entry["file"])], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"prebuild: cuobjdump failed on {entry['file']}: {r.stderr.strip()[-800:]}")
        parts.append(f"## {entry['file']}\n{r.stdout}")
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    manifest["cuobjdump"] = ver[-1] if ver else exe
    return "\n".join(parts)


GPU_MODULES = ("ds_ttt_flashbob_cuda", "ds_ttt_mma_probe_cuda")  # what the GPU machine loads from the folder


def check_current(out: Path, capability: tuple[int, int] = (9, 0)) -> tuple[bool, list[str]]:
    """Whether the prebuilt folder is what the loader would use on a GPU of `capability` (default the
    H200's sm_90): the manifest, its files, and builder.prebuilt_mismatch (kernel sources' sha256,
    architectures; torch / Python for a torch-ABI module) for each GPU module. Returns (ok, lines)."""
    import platform

    from ds_ttt.ops.flashbob.builder import prebuilt_mismatch, sources_digest

    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        return False, [f"{out / 'manifest.json'}: not usable ({type(exc).__name__}: {exc}); run bash gpu_check/prebuild.sh"]
    digest = sources_digest()
    lines = [f"manifest {out / 'manifest.json'}: built {manifest.get('built_at')}, sources sha256 "
             f"{str(manifest.get('sources_sha256'))[:16]}, current sources {digest[:16]}, archs {manifest.get('arch_list')}"]
    ok = True
    for name in GPU_MODULES:  # C-ABI entries: the rule skips torch and Python (they depend on neither)
        why = prebuilt_mismatch(manifest, name, torch_version=manifest.get("torch", ""),
                                python=platform.python_version_tuple()[0] + "." + platform.python_version_tuple()[1],
                                digest=digest, capability=capability)
        entry = (manifest.get("modules") or {}).get(name) or {}
        if not why and not (out / entry.get("file", "")).is_file():
            why = f"{out / entry.get('file', '?')} is missing"
        ok &= not why
        lines.append(f"{name}: " + (f"current for sm_{capability[0]}{capability[1]} ({entry.get('file')}, "
                                    f"{entry.get('abi')} ABI)" if not why else f"NOT current: {why}"))
    return ok, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the objects (default %(default)s)")
    ap.add_argument("--log", default=None, help="also write the cuobjdump dump with a header to this file")
    ap.add_argument("--check", action="store_true",
                    help="build nothing: say whether --out is current for the loader (exit 0) or not (exit 1)")
    ap.add_argument("--capability", default="9.0", help="GPU compute capability for --check (default %(default)s)")
    a = ap.parse_args(argv)
    if a.check:
        try:
            cap = tuple(int(x) for x in a.capability.split("."))
            assert len(cap) == 2
        except (ValueError, AssertionError):
            ap.error(f"--capability must look like 9.0, got {a.capability!r}")
        ok, lines = check_current(Path(a.out).resolve(), cap)
        print("\n".join(f"[prebuild --check] {ln}" for ln in lines))
        print(f"[prebuild --check] {'current' if ok else 'STALE: rerun bash gpu_check/prebuild.sh'}")
        return 0 if ok else 1
    out = Path(a.out).resolve()
    t0 = time.perf_counter()
    manifest = build_all(out)
    dump = dump_resource_usage(out, manifest)
    (out / "resource_usage.txt").write_text(dump)
    manifest["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if a.log:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        header = [f"# cuobjdump --dump-resource-usage of the prebuilt GPU objects (gpu_check/prebuild.sh)",
                  f"# built {manifest['built_at']} at commit {commit} (sources sha256 {manifest['sources_sha256'][:16]})",
                  f"# nvcc {manifest['nvcc']}; cuobjdump {manifest['cuobjdump']}; archs {manifest['arch_list']}; "
                  f"nvcc -shared -cudart static of csrc/flashbob_cuda_kernel.cu, mma_probe.cu, flashbob_capi.cpp",
                  f"# nvcc flags: {' '.join(manifest['nvcc_args'])}", ""]
        Path(a.log).parent.mkdir(parents=True, exist_ok=True)
        Path(a.log).write_text("\n".join(header) + dump)
        print(f"[prebuild] resource usage log: {a.log}", flush=True)
    files = {m["file"]: m["bytes"] for m in manifest["modules"].values()}
    print(f"[prebuild] OK: {out} ({sum(files.values()) / 2**20:.1f} MiB) "
          f"in {manifest['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
