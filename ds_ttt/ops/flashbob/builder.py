"""DeepSpeed op builders for the FlashBoB kernels (JIT-compiled lazily, never at import).

    FlashBoBCPUBuilder(OpBuilder)       csrc/flashbob_cpu.cpp        NAME "ds_ttt_flashbob_cpu"
    FlashBoBCUDABuilder(CUDAOpBuilder)  csrc/flashbob_cuda.cpp + .cu NAME "ds_ttt_flashbob_cuda"
    FlashBoBCUDAEmuBuilder(OpBuilder)   csrc/emu/ (the .cu on CPU)   NAME "ds_ttt_flashbob_cuda_emu"
                                        test-only: runs the CUDA kernels' logic without a GPU

Both return absolute source/include paths (DeepSpeed resolves relative ones inside its own
package). `load_cpu_op()` / `load_cuda_op()` build on first call and cache the module; the build
cache is $TORCH_EXTENSIONS_DIR, defaulted (only when unset) to <repo>/.torch_extensions/
torch-<version> so that CPU and CUDA torch builds never share objects.

CUDA compile check without a GPU: .ci/cuda_build_check.sh (needs a CUDA torch build and CUDA_HOME;
it builds for FlashBoBCUDABuilder.ARCH_LIST, sm_80 and sm_90, and checks the PTX for mma.sync).
At run time with a GPU visible and TORCH_CUDA_ARCH_LIST unset, DeepSpeed builds for that GPU.
The kernels need sm_80 or later (bf16 mma.sync m16n8k16, ldmatrix, cp.async).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

CSRC = Path(__file__).resolve().parent / "csrc"
REPO_ROOT = Path(__file__).resolve().parents[3]

__all__ = ["FlashBoBCPUBuilder", "FlashBoBCUDABuilder", "FlashBoBCUDAEmuBuilder", "load_cpu_op",
           "load_cuda_op", "load_cuda_emu_op", "default_extensions_dir"]


def default_extensions_dir() -> Path:
    """Project-local JIT cache, one per torch build (CPU and CUDA wheels differ)."""
    tag = torch.__version__.replace("+", "-")
    return REPO_ROOT / ".torch_extensions" / f"torch-{tag}"


def _ensure_extensions_dir() -> None:
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


def load_cpu_op():
    """Build (first call only, ~30 s cold) and return the CPU extension module."""
    if "cpu" not in _OPS:
        _ensure_extensions_dir()
        builder = FlashBoBCPUBuilder()
        if not builder.is_compatible():
            raise RuntimeError(f"flashbob cpu backend unavailable: {builder.incompatible_reason}")
        _OPS["cpu"] = builder.load(verbose=False)
    return _OPS["cpu"]


def load_cuda_emu_op():
    """Build and return the CPU-emulated CUDA kernels (tests only; slow, one thread per lane)."""
    if "cuda_emu" not in _OPS:
        _ensure_extensions_dir()
        _OPS["cuda_emu"] = FlashBoBCUDAEmuBuilder().load(verbose=False)
    return _OPS["cuda_emu"]


def load_cuda_op():
    """Build (first call only) and return the CUDA extension module."""
    if "cuda" not in _OPS:
        _ensure_extensions_dir()
        builder = FlashBoBCUDABuilder()
        if not builder.is_compatible():
            raise RuntimeError(f"flashbob cuda backend unavailable: {builder.incompatible_reason}")
        _OPS["cuda"] = builder.load(verbose=False)
    return _OPS["cuda"]
