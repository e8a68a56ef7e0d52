"""DeepSpeed op builders for the FlashBoB kernels (JIT-compiled lazily, never at import).

    FlashBoBCPUBuilder(OpBuilder)       csrc/flashbob_cpu.cpp        NAME "ds_ttt_flashbob_cpu"
    FlashBoBCUDABuilder(CUDAOpBuilder)  csrc/flashbob_cuda.cpp + .cu NAME "ds_ttt_flashbob_cuda"
    FlashBoBCUDAEmuBuilder(OpBuilder)   csrc/emu/ (the .cu on CPU)   NAME "ds_ttt_flashbob_cuda_emu"
                                        test-only: runs the CUDA kernels' logic without a GPU

Both return absolute source/include paths (DeepSpeed resolves relative ones inside its own
package). `load_cpu_op()` / `load_cuda_op()` build on first call and cache the module; the build
cache is $TORCH_EXTENSIONS_DIR, defaulted (only when unset) to <repo>/.torch_extensions/
torch-<version> so that CPU and CUDA torch builds never share objects.

Prebuilt objects (no JIT on a GPU machine): `bash gpu_check/prebuild.sh` compiles, here, the
kernels and the tensor-core probe for sm_80 + sm_90 into one C-ABI library (csrc/flashbob_capi.cpp,
driven by capi.py through ctypes: independent of the torch and Python versions) and the emulated
probe as a torch extension, into gpu_check/prebuilt/ (git-ignored) with a manifest.json
(architectures, sha256 of every csrc file; torch / Python for the torch extension). The loaders
use a prebuilt module when its manifest matches the current sources, this GPU (and, for a torch
extension, this torch and Python), else JIT-build as before; `load_info()` tells which path each op took, why, and
how long it took. DS_TTT_FLASHBOB_PREBUILT=DIR points at another folder, =0 forces JIT.

CUDA compile check without a GPU: .ci/cuda_build_check.sh (needs a CUDA torch build and CUDA_HOME;
it builds for FlashBoBCUDABuilder.ARCH_LIST, sm_80 and sm_90, and checks the PTX for mma.sync).
At run time with a GPU visible and TORCH_CUDA_ARCH_LIST unset, DeepSpeed builds for that GPU.
The kernels need sm_80 or later (bf16 mma.sync m16n8k16, ldmatrix, cp.async).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

CSRC = Path(__file__).resolve().parent / "csrc"
REPO_ROOT = Path(__file__).resolve().parents[3]

__all__ = ["FlashBoBCPUBuilder", "FlashBoBCUDABuilder", "FlashBoBCUDAEmuBuilder", "load_cpu_op",
           "load_cuda_op", "load_cuda_emu_op", "default_extensions_dir", "load_info", "load_with_prebuilt",
           "sources_digest", "ensure_extensions_dir", "DEFAULT_PREBUILT_DIR"]
DEFAULT_PREBUILT_DIR = REPO_ROOT / "gpu_check" / "prebuilt"


def default_extensions_dir() -> Path:
    """Project-local JIT cache, one per torch build (CPU and CUDA wheels differ)."""
    tag = torch.__version__.replace("+", "-")
    return REPO_ROOT / ".torch_extensions" / f"torch-{tag}"


def ensure_extensions_dir() -> None:
    """Point TORCH_EXTENSIONS_DIR at the project's folder (default_extensions_dir) unless the user set it."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(default_extensions_dir())


class FlashBoBCPUBuilder(OpBuilder):
    """C++ tiled kernels (ATen + OpenMP), float32/float64."""

    BUILD_VAR = "DS_BUILD_DS_TTT_FLASHBOB_CPU"
    NAME = "ds_ttt_flashbob_cpu"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"ds_ttt.ops.flashbob.{self.NAME}_op"

    def sources(self):
        return [str(CSRC / "flashbob_cpu.cpp")]

    def include_paths(self):
        return [str(CSRC)]

    def cxx_args(self):
        # -fno-math-errno lets the `omp simd` loops (rounding in the polynomial exp2) vectorize;
        # no -ffast-math because the kernels rely on ±inf (masked logits, fully masked rows).
        return ["-O3", self.cpu_arch(), "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                "-Wno-reorder"]

    def extra_ldflags(self):
        return ["-fopenmp"]

    def is_compatible(self, verbose=False):
        self.incompatible_reason = ""
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            self.incompatible_reason = "no C++ compiler on PATH (set CXX)"
        self.error_log = self.incompatible_reason or None
        return not self.incompatible_reason


class FlashBoBCUDABuilder(CUDAOpBuilder):
    """Tensor-core CUDA kernels (mma.sync): bf16/fp16 storage, fp32 accumulation, head dims 64/128."""

    BUILD_VAR = "DS_BUILD_DS_TTT_FLASHBOB_CUDA"
    NAME = "ds_ttt_flashbob_cuda"
    # Architectures the compile check (and any GPU-less build) targets: A100 (sm_80), H100/H200
    # (sm_90). Format of TORCH_CUDA_ARCH_LIST.
    ARCH_LIST = "8.0;9.0"

    def __init__(self):
        super().__init__(name=self.NAME)
        self.incompatible_reason = ""

    def absolute_name(self):
        return f"ds_ttt.ops.flashbob.{self.NAME}_op"

    def sources(self):
        # flashbob_cuda_kernel.cu includes flashbob_cuda_tiles.cuh and mma.cuh (tensor-core PTX).
        return [str(CSRC / "flashbob_cuda.cpp"), str(CSRC / "flashbob_cuda_kernel.cu")]

    def include_paths(self):
        return [str(CSRC)]

    def cxx_args(self):
        return ["-O3", "-Wno-reorder"]

    def nvcc_args(self):
        # Chosen deliberately (not the base list): no --use_fast_math (exp2f/log2f stay IEEE-ish;
        # second derivatives are sensitive), C++20 as the torch headers require, half/bf16
        # operators enabled. Arch flags come from TORCH_CUDA_ARCH_LIST via torch.
        # DS_TTT_FLASHBOB_NVCC_FLAGS appends flags (e.g. -Xptxas=-v, or
        # -DFLASHBOB_FORCE_COMPILE_ERROR to prove that .ci/cuda_build_check.sh fails).
        extra = os.environ.get("DS_TTT_FLASHBOB_NVCC_FLAGS", "").split()
        return ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo",
                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__"] + extra

    def is_compatible(self, verbose=False):
        from torch.utils import cpp_extension

        reason = ""
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU-only build (no CUDA toolkit support)"
        elif cpp_extension.CUDA_HOME is None:
            reason = "CUDA_HOME is not set and no nvcc was found"
        elif not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
            reason = f"no nvcc under CUDA_HOME={cpp_extension.CUDA_HOME}"
        elif torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if major < 8:
                reason = f"GPU compute capability {major}.{minor} < 8.0 (bf16 kernels need sm80+)"
        elif not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            reason = ("no GPU visible and TORCH_CUDA_ARCH_LIST unset: nothing to compile for "
                      f"(set TORCH_CUDA_ARCH_LIST={self.ARCH_LIST!r})")
        self.incompatible_reason = reason
        self.error_log = reason or None
        if reason and verbose:
            self.warning(f"{self.NAME} is not compatible: {reason}")
        return not reason


class FlashBoBCUDAEmuBuilder(OpBuilder):
    """Test-only: the CUDA kernel source compiled for the CPU through csrc/emu/cuda_emu.h."""

    BUILD_VAR = "DS_BUILD_DS_TTT_FLASHBOB_CUDA_EMU"
    NAME = "ds_ttt_flashbob_cuda_emu"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"ds_ttt.ops.flashbob.{self.NAME}_op"

    def sources(self):
        return [str(CSRC / "emu" / "flashbob_cuda_emu.cpp")]

    def include_paths(self):
        return [str(CSRC), str(CSRC / "emu")]

    def cxx_args(self):
        return ["-O1", "-Wno-reorder"]


_OPS: dict[str, object] = {}
_LOAD_INFO: dict[str, dict] = {}


def sources_digest() -> str:
    """sha256 over every kernel source file (csrc/ and csrc/emu/): a prebuilt object is only
    used for the sources it was built from."""
    h = hashlib.sha256()
    for f in sorted(list(CSRC.glob("*")) + list((CSRC / "emu").glob("*"))):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _prebuilt_dir() -> Path | None:
    value = os.environ.get("DS_TTT_FLASHBOB_PREBUILT", "")
    if value == "0":
        return None
    return Path(value) if value else DEFAULT_PREBUILT_DIR


def prebuilt_mismatch(manifest: dict, name: str, *, torch_version: str, python: str, digest: str,
                      capability: tuple[int, int] | None) -> str:
    """Why the manifest's `name` cannot be used here ("" when it can)."""
    entry = (manifest.get("modules") or {}).get(name)
    if not entry:
        return f"the manifest has no module {name}"
    if entry.get("abi") != "c":  # a torch extension; the C-ABI library depends on neither
        if manifest.get("torch") != torch_version:
            return f"built for torch {manifest.get('torch')}, this is torch {torch_version}"
        if manifest.get("python") != python:
            return f"built for Python {manifest.get('python')}, this is Python {python}"
    if manifest.get("sources_sha256") != digest:
        return "the kernel sources changed since the prebuild (rerun bash gpu_check/prebuild.sh)"
    if entry.get("gpu") and capability is not None:
        archs = [tuple(int(x) for x in a.split(".")) for a in manifest.get("arch_list", "").split(";") if a]
        # A cubin runs on its own major version at an equal or higher minor (sm_80 on sm_86/89);
        # there is no PTX in the objects, so sm_90 runs only on 9.x and nothing runs on a newer major.
        if not any(capability[0] == a[0] and capability[1] >= a[1] for a in archs):
            return f"built for sm {manifest.get('arch_list')}, this GPU is sm_{capability[0]}{capability[1]}"
    return ""


def load_with_prebuilt(name: str, jit_load, *, gpu: bool, capi=None):
    """The prebuilt module `name` when the manifest fits (a C-ABI entry is wrapped by `capi`, a class
    of capi.py), else `jit_load()`; records which, why and how long."""
    t0 = time.perf_counter()
    info: dict = {"module": name}
    folder = _prebuilt_dir()
    reason = "disabled (DS_TTT_FLASHBOB_PREBUILT=0)" if folder is None else ""
    if folder is not None:
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            manifest, reason = None, f"no usable {folder / 'manifest.json'} ({type(exc).__name__}); build one with " \
                                     "bash gpu_check/prebuild.sh"
        if manifest is not None:
            cap = torch.cuda.get_device_capability() if gpu and torch.cuda.is_available() else None
            reason = "no CUDA GPU visible" if gpu and cap is None else prebuilt_mismatch(manifest, name, torch_version=torch.__version__,
                                       python="%d.%d" % sys.version_info[:2], digest=sources_digest(),
                                       capability=cap)
            path = folder / manifest["modules"][name]["file"] if not reason else None
            if path is not None and not path.is_file():
                reason = f"{path} is missing"
            abi = manifest["modules"][name].get("abi", "torch") if not reason else None
            if not reason and abi == "c":
                try:
                    module = capi(path) if capi is not None else None
                except (OSError, ImportError) as exc:
                    reason = f"loading {path} failed: {exc}"
                else:
                    if module is None:
                        reason = f"{name} is a C-ABI entry but the loader has no wrapper for it"
                    else:
                        info.update(path="prebuilt", abi="c", file=str(path), seconds=round(time.perf_counter() - t0, 3))
                        _LOAD_INFO[name] = info
                        return module
            elif not reason:
                try:
                    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
                    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
                    module = importlib.util.module_from_spec(spec)
                    loader.exec_module(module)
                except ImportError as exc:
                    reason = f"import of {path} failed: {exc}"
                else:
                    info.update(path="prebuilt", abi="torch", file=str(path), seconds=round(time.perf_counter() - t0, 3))
                    _LOAD_INFO[name] = info
                    return module
    info["prebuilt_skipped"] = reason
    module = jit_load()
    info.update(path="jit", seconds=round(time.perf_counter() - t0, 3),
                file=getattr(module, "__file__", None))
    _LOAD_INFO[name] = info
    return module


def load_info() -> dict[str, dict]:
    """{module name: {"path": "prebuilt"|"jit", "seconds", "file", "prebuilt_skipped"}} so far."""
    return {k: dict(v) for k, v in _LOAD_INFO.items()}


def load_cpu_op():
    """Build (first call only, ~30 s cold) and return the CPU extension module."""
    if "cpu" not in _OPS:
        ensure_extensions_dir()
        builder = FlashBoBCPUBuilder()
        if not builder.is_compatible():
            raise RuntimeError(f"flashbob cpu backend unavailable: {builder.incompatible_reason}")
        _OPS["cpu"] = builder.load(verbose=False)
    return _OPS["cpu"]


def load_cuda_emu_op():
    """Build and return the CPU-emulated CUDA kernels (tests only; slow, one thread per lane)."""
    if "cuda_emu" not in _OPS:
        ensure_extensions_dir()
        _OPS["cuda_emu"] = FlashBoBCUDAEmuBuilder().load(verbose=False)
    return _OPS["cuda_emu"]


def load_cuda_op():
    """The CUDA extension module: prebuilt when it fits (see above), else built (first call only)."""
    if "cuda" not in _OPS:
        ensure_extensions_dir()
        builder = FlashBoBCUDABuilder()

        def jit():
            if not builder.is_compatible():
                raise RuntimeError(f"flashbob cuda backend unavailable: {builder.incompatible_reason}")
            return builder.load(verbose=False)
        from .capi import FlashBoBLib

        _OPS["cuda"] = load_with_prebuilt(builder.NAME, jit, gpu=True, capi=FlashBoBLib)
    return _OPS["cuda"]
