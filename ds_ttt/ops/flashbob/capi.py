"""The prebuilt FlashBoB kernels and tensor-core probe through their C ABI (ctypes): no JIT, any torch.

    from ds_ttt.ops.flashbob.capi import FlashBoBLib, ProbeLib
    op = FlashBoBLib("gpu_check/prebuilt/libflashbob_cuda.so")   # .fwd / .bwd / .bwd_bwd
    probe = ProbeLib("gpu_check/prebuilt/libflashbob_cuda.so")   # .run (as the probe binding)

csrc/flashbob_capi.cpp exports the launchers of flashbob_cuda_kernel.cu and mma_probe.cu with
plain C types; gpu_check/prebuild_ops.py compiles it here with nvcc for sm_80 + sm_90 with
cudart linked statically (as NCCL does), so the library depends on no torch and no Python version
and a GPU machine imports it instead of JIT-building the torch extension (builder.load_cuda_op
picks it when its manifest matches the sources and the GPU). These classes do what the torch
bindings do (flashbob_cuda.cpp, mma_probe_bindings.h): the same input checks with the same
messages, output allocation, the current CUDA stream, an error naming the kernel enqueued last, and
the tile-set functions (num_tile_sets, tile_set_json, set_tile_set, ...; see tiles.py).

device_type="cpu" drives the emulated build of the same C file (csrc/emu/capi_emu.cpp) with CPU
tensors: tests/unit/test_flashbob_builder.py checks this path against the reference without a GPU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

__all__ = ["FlashBoBLib", "ProbeLib", "CAPI_VERSION"]

CAPI_VERSION = 2  # 2: tile sets
_P = ctypes.c_void_p
_I64P = ctypes.POINTER(ctypes.c_int64)


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class _Lib:
    def __init__(self, path: str | Path, device_type: str = "cuda"):
        if device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.init()  # the primary context exists before the library's static cudart sees it
        self.path, self.device_type = str(path), device_type
        self.lib = ctypes.CDLL(self.path)
        lib = self.lib
        lib.flashbob_capi_version.restype = ctypes.c_int
        version = lib.flashbob_capi_version()
        if version != CAPI_VERSION:
            raise ImportError(f"{self.path}: C ABI version {version}, this code needs {CAPI_VERSION}; rebuild it with "
                              "bash gpu_check/prebuild.sh")
        lib.flashbob_last_kernel.restype = ctypes.c_char_p
        lib.flashbob_error_string.restype = ctypes.c_char_p
        lib.flashbob_error_string.argtypes = [ctypes.c_int]
        self.__file__ = self.path

    def _stream(self, t: torch.Tensor):
        return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else None

    def _error(self, err: int) -> str:
        return self.lib.flashbob_error_string(err).decode(errors="replace")


class FlashBoBLib(_Lib):
    """fwd / bwd / bwd_bwd with the signatures and checks of the torch binding (flashbob_cuda.cpp)."""

    def __init__(self, path, device_type: str = "cuda"):
        super().__init__(path, device_type)
        ints = [ctypes.c_int, ctypes.c_int]
        tail = [_I64P, ctypes.c_float, _P]
        self.lib.flashbob_fwd.argtypes = ints + [_P] * 5 + tail
        self.lib.flashbob_bwd.argtypes = ints + [_P] * 10 + tail
        self.lib.flashbob_bwd_bwd.argtypes = ints + [_P] * 16 + tail
        for f in (self.lib.flashbob_fwd, self.lib.flashbob_bwd, self.lib.flashbob_bwd_bwd):
            f.restype = ctypes.c_int
        lib = self.lib
        for f in (lib.flashbob_num_tile_sets, lib.flashbob_tile_set, lib.flashbob_device_tile_set,
                  lib.flashbob_active_tile_set):
            f.restype, f.argtypes = ctypes.c_int, []
        lib.flashbob_set_tile_set.restype, lib.flashbob_set_tile_set.argtypes = ctypes.c_int, [ctypes.c_int]
        lib.flashbob_tile_set_json.restype, lib.flashbob_tile_set_json.argtypes = ctypes.c_char_p, [ctypes.c_int]
        lib.flashbob_tile_set_unavailable.restype = ctypes.c_char_p
        lib.flashbob_tile_set_unavailable.argtypes = [ctypes.c_int, ctypes.c_int]

    # -- tile sets (flashbob_cuda.h; the torch binding's functions of the same names) --
    def num_tile_sets(self) -> int:
        return self.lib.flashbob_num_tile_sets()

    def tile_set_json(self, set_id: int) -> str:
        j = self.lib.flashbob_tile_set_json(set_id)
        if j is None:
            raise RuntimeError(f"flashbob cuda: no tile set {set_id}")
        return j.decode()

    def set_tile_set(self, set_id: int) -> None:
        if self.lib.flashbob_set_tile_set(set_id) != 0:
            raise RuntimeError(f"flashbob cuda: no tile set {set_id} (0..{self.num_tile_sets() - 1}, or -1 for "
                               "the device's)")

    def tile_set(self) -> int:
        return self.lib.flashbob_tile_set()

    def device_tile_set(self) -> int:
        return self.lib.flashbob_device_tile_set()

    def active_tile_set(self) -> int:
        return self.lib.flashbob_active_tile_set()

    def _check_tile_set(self, q) -> None:
        why = self.lib.flashbob_tile_set_unavailable(self._dt(q), q.shape[3])
        if why is not None:
            raise RuntimeError(f"flashbob cuda: {why.decode()}")

    # -- checks (the binding's TORCH_CHECKs, same wording) --
    def _check_input(self, t: torch.Tensor, name: str, ref: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            raise RuntimeError(f"{name} must be a {self.device_type.upper()} tensor, got {t.device}")
        if t.device != ref.device:
            raise RuntimeError(f"{name} is on {t.device}, q on {ref.device}")
        if t.dtype != ref.dtype:
            raise RuntimeError(f"{name} dtype {t.dtype} differs from q dtype {ref.dtype}")
        if t.dim() != 4:
            raise RuntimeError(f"{name} must have rank 4 [B, H, N, D], got {t.dim()}")
        if not t.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            raise RuntimeError(f"{name} must start at a 16-byte aligned address (storage offset "
                               f"{t.storage_offset()} elements); pass {name}.clone()")

    def _check_like(self, t, name, ref) -> None:
        self._check_input(t, name, ref)
        if t.shape != ref.shape:
            raise RuntimeError(f"{name} shape {list(t.shape)} must equal {list(ref.shape)}")

    def _geo(self, q, k, v, causal, window, q_off, k_off):
        for t, n in ((q, "q"), (k, "k"), (v, "v")):
            self._check_input(t, n, q)
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(f"flashbob cuda supports bfloat16/float16, got {q.dtype}")
        if q.shape[3] not in (64, 128):
            raise RuntimeError(f"flashbob cuda supports head dim 64/128, got {q.shape[3]}")
        if k.shape != v.shape:
            raise RuntimeError("k and v shapes differ")
        if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise RuntimeError("q/k batch or head dim differ")
        if not (k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0):
            raise RuntimeError("Hq must be a multiple of Hkv")
        if not (window >= 0 and (causal or window == 0)):
            raise RuntimeError("window must be >= 0 and needs causal")
        if not (q.shape[0] * q.shape[1] < 65536 and k.shape[0] * k.shape[1] < 65536):
            raise RuntimeError("B*H must be < 65536 (grid.y)")
        G = q.shape[1] // k.shape[1]
        if q.shape[2] * G >= 2**31:
            raise RuntimeError(f"Nq * (Hq / Hkv) must be < 2^31, got {q.shape[2]} * {G}")
        g = (ctypes.c_int64 * 10)(q.shape[0], q.shape[1], k.shape[1], G, q.shape[2], k.shape[2], int(bool(causal)),
                                  window, q_off, k_off)
        return g

    def _dt(self, q):
        return 0 if q.dtype == torch.bfloat16 else 1

    def _launch(self, what: str, fn, *args) -> None:
        err = fn(*args)
        if err != 0:
            kernel = self.lib.flashbob_last_kernel().decode()
            raise RuntimeError(f"flashbob cuda {what} failed in {kernel}: {self._error(err)} (an execution fault is "
                               "reported by the kernel it happened in only with CUDA_LAUNCH_BLOCKING=1)")

    def last_launched_kernel(self) -> str:
        return self.lib.flashbob_last_kernel().decode()

    def _guard(self, q):
        return torch.cuda.device(q.device) if q.is_cuda else _Null()

    def fwd(self, q, k, v, causal, window, q_off, k_off, scale):
        g = self._geo(q, k, v, causal, window, q_off, k_off)
        with self._guard(q):
            self._check_tile_set(q)
            o = torch.empty_like(q)
            stats = torch.empty(q.shape[0], q.shape[1], q.shape[2], 2, device=q.device, dtype=torch.float32)
            self._launch("fwd", self.lib.flashbob_fwd, self._dt(q), q.shape[3], _ptr(q), _ptr(k), _ptr(v), _ptr(o),
                         _ptr(stats), g, scale, self._stream(q))
        return [o, stats]

    def _check_stats(self, stats, q):
        if not (stats.device == q.device and stats.is_contiguous() and stats.dtype == torch.float32
                and stats.numel() == q.shape[0] * q.shape[1] * q.shape[2] * 2):
            raise RuntimeError("stats must be a contiguous float32 CUDA tensor [B, Hq, Nq, 2]")

    def bwd(self, q, k, v, o, stats, dout, causal, window, q_off, k_off, scale):
        g = self._geo(q, k, v, causal, window, q_off, k_off)
        self._check_like(o, "o", q)
        self._check_like(dout, "dout", q)
        self._check_stats(stats, q)
        with self._guard(q):
            self._check_tile_set(q)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            self._launch("bwd", self.lib.flashbob_bwd, self._dt(q), q.shape[3], _ptr(q), _ptr(k), _ptr(v), _ptr(o),
                         _ptr(stats), _ptr(dout), _ptr(dq), _ptr(dk), _ptr(dv), _ptr(delta), g, scale, self._stream(q))
        return [dq, dk, dv]

    def bwd_bwd(self, q, k, v, o, stats, dout, dq, uq, uk, uv, causal, window, q_off, k_off, scale):
        g = self._geo(q, k, v, causal, window, q_off, k_off)
        self._check_like(o, "o", q)
        self._check_like(dout, "dout", q)
        self._check_like(dq, "dq", q)
        self._check_stats(stats, q)
        for t, n, ref in ((uq, "uq", q), (uk, "uk", k), (uv, "uv", k)):
            if t is not None:
                self._check_like(t, n, ref)
        if uq is None and uk is None and uv is None:
            raise RuntimeError("bwd_bwd needs at least one tangent")
        with self._guard(q):
            self._check_tile_set(q)
            qbar, dobar, kbar, vbar = torch.empty_like(q), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            alpha, e0 = torch.empty_like(delta), torch.empty_like(delta)
            self._launch("bwd_bwd", self.lib.flashbob_bwd_bwd, self._dt(q), q.shape[3], _ptr(q), _ptr(k), _ptr(v),
                         _ptr(o), _ptr(stats), _ptr(dout), _ptr(uq), _ptr(uk), _ptr(uv), _ptr(qbar), _ptr(kbar),
                         _ptr(vbar), _ptr(dobar), _ptr(delta), _ptr(alpha), _ptr(e0), g, scale, self._stream(q))
        return [qbar, kbar, vbar, dobar, delta, alpha, e0]


class ProbeLib(_Lib):
    """run(op, variant, nthreads, src16, offsets, in_u, in_f, n_out_u, n_out_f) -> (out_u, out_f),
    as the probe binding (mma_probe_bindings.h)."""

    def __init__(self, path, device_type: str = "cuda"):
        super().__init__(path, device_type)
        self.lib.mma_probe_run.argtypes = [ctypes.c_int] * 4 + [_P] * 6
        self.lib.mma_probe_run.restype = ctypes.c_int

    def _check(self, t, dtype, name):
        if not (t.dim() == 1 and t.is_contiguous()):
            raise RuntimeError(f"mma probe: {name} must be a contiguous 1-d tensor")
        if t.dtype != dtype:
            raise RuntimeError(f"mma probe: {name} must be {dtype}, got {t.dtype}")
        if t.device.type != self.device_type:
            raise RuntimeError(f"mma probe: {name} must be on {'the GPU' if self.device_type == 'cuda' else 'the CPU'}")

    def run(self, op, variant, nthreads, src16, offsets, in_u, in_f, n_out_u, n_out_f):
        for t, dt, n in ((src16, torch.int16, "src16"), (offsets, torch.int32, "offsets"), (in_u, torch.int32, "in_u"),
                         (in_f, torch.float32, "in_f")):
            self._check(t, dt, n)
        if not (0 < nthreads <= 1024 and nthreads % 32 == 0):
            raise RuntimeError(f"mma probe: nthreads must be a multiple of 32 in 32..1024, got {nthreads}")
        out_u = torch.zeros(n_out_u, dtype=torch.int32, device=in_u.device)
        out_f = torch.zeros(n_out_f, dtype=torch.float32, device=in_f.device)
        err = self.lib.mma_probe_run(op, variant, nthreads, src16.numel(), _ptr(src16), _ptr(offsets), _ptr(in_u),
                                     _ptr(in_f), _ptr(out_u), _ptr(out_f))
        if err != 0:
            raise RuntimeError(f"mma probe launch failed: {self._error(err)}")
        return out_u, out_f


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
