"""DeepSpeed op builders for the tensor-core probe kernels (csrc/mma_probe.cu), tests only.

    MmaProbeEmuBuilder(OpBuilder)       csrc/emu/mma_probe_emu.cpp   NAME "ds_ttt_mma_probe_emu"
                                        the probe through the CPU emulator (emu/mma_emu.h)
    MmaProbeCUDABuilder(CUDAOpBuilder)  csrc/mma_probe_cuda.cpp + .cu NAME "ds_ttt_mma_probe_cuda"
                                        the same probe on the GPU (inline PTX of csrc/mma.cuh)

    from ds_ttt.ops.flashbob.probe_builder import load_probe_emu, load_probe_cuda
    out_u, out_f = load_probe_emu().run(op, variant, nthreads, src16, offsets, in_u, in_f, nu, nf)

tests/unit/test_mma_emu.py checks the emulated instructions against plain matrix products;
tests/ops/test_mma_probe_cuda.py runs both builds and requires identical per-lane registers.
The GPU build reuses the FlashBoB CUDA builder's compatibility rules and nvcc flags, so it
compiles for the same architectures (TORCH_CUDA_ARCH_LIST, or the visible GPU). Both loaders
import the objects of gpu_check/prebuild.sh when they fit (builder.load_with_prebuilt).
"""

from __future__ import annotations

from deepspeed.ops.op_builder.builder import OpBuilder

from .builder import CSRC, FlashBoBCUDABuilder, ensure_extensions_dir, load_with_prebuilt

__all__ = ["MmaProbeEmuBuilder", "MmaProbeCUDABuilder", "load_probe_emu", "load_probe_cuda"]


class MmaProbeEmuBuilder(OpBuilder):
    """The probe kernels compiled as C++ through csrc/emu/cuda_emu.h (no GPU needed)."""

    BUILD_VAR = "DS_BUILD_DS_TTT_MMA_PROBE_EMU"
    NAME = "ds_ttt_mma_probe_emu"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"ds_ttt.ops.flashbob.{self.NAME}_op"

    def sources(self):
        return [str(CSRC / "emu" / "mma_probe_emu.cpp")]

    def include_paths(self):
        return [str(CSRC), str(CSRC / "emu")]

    def cxx_args(self):
        return ["-O1", "-std=c++20", "-Wno-reorder"]


class MmaProbeCUDABuilder(FlashBoBCUDABuilder):
    """The probe kernels on the GPU; same compatibility checks and nvcc flags as the op."""

    BUILD_VAR = "DS_BUILD_DS_TTT_MMA_PROBE_CUDA"
    NAME = "ds_ttt_mma_probe_cuda"

    def sources(self):
        return [str(CSRC / "mma_probe_cuda.cpp"), str(CSRC / "mma_probe.cu")]


_PROBES: dict[str, object] = {}


def load_probe_emu():
    """Build (first call only) and return the emulated probe module."""
    if "emu" not in _PROBES:
        ensure_extensions_dir()
        _PROBES["emu"] = load_with_prebuilt(MmaProbeEmuBuilder.NAME,
                                            lambda: MmaProbeEmuBuilder().load(verbose=False), gpu=False)
    return _PROBES["emu"]


def load_probe_cuda():
    """Build (first call only) and return the GPU probe module; RuntimeError if it cannot."""
    if "cuda" not in _PROBES:
        ensure_extensions_dir()
        builder = MmaProbeCUDABuilder()

        def jit():
            if not builder.is_compatible():
                raise RuntimeError(f"mma probe cuda build unavailable: {builder.incompatible_reason}")
            return builder.load(verbose=False)
        from .capi import ProbeLib

        _PROBES["cuda"] = load_with_prebuilt(builder.NAME, jit, gpu=True, capi=ProbeLib)
    return _PROBES["cuda"]
