"""FlashBoB: exact, twice-differentiable softmax attention with O(N·d) memory.

Public entry point:

    from ds_ttt.ops.flashbob import attention
    o = attention(q, k, v, causal=True, scale=None, window=0, q_offset=None, k_offset=0,
                  backend="auto")

q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] with Hq a multiple of Hkv (GQA/MQA; K/V are never repeated
in memory by the kernels). Absolute positions are i = local + q_offset, j = local + k_offset;
q_offset=None right-aligns the queries (q_offset = Nk - Nq + k_offset). Causal row i sees j iff
0 <= i - j (and i - j < window when window > 0). Fully masked rows give zeros.

Backends:
  "reference"  readable PyTorch math (reference.py), any device/dtype, O(N²) memory.
  "cpu"        C++ tiled kernels (csrc/flashbob_cpu.cpp), float32/float64, JIT-built on first use.
  "cuda"       CUDA kernels (csrc/*.cu), bf16/fp16, head dim 64/128, JIT-built on first use.
  "auto"       "cpu" for CPU tensors, "cuda" for CUDA tensors.
`choose_backend(requested, device=..., dtype=..., head_dim=...)` says which backend a request runs on
(or why it cannot) without any tensor; `attention` decides by the same function.
The cpu/cuda backends support first grads with create_graph=True and a second backward
(backward-over-backward); a third derivative raises. Nothing is compiled at import time.
Math and schedule: docs/flashbob_math.md; usage and numbers: docs/flashbob.md.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch

from .reference import attention_reference, default_q_offset, visibility_mask

__all__ = ["attention", "attention_reference", "choose_backend", "visibility_mask", "BACKENDS"]

BACKENDS = ("auto", "reference", "cpu", "cuda")
CPU_DTYPES = (torch.float32, torch.float64)
CUDA_DTYPES = (torch.bfloat16, torch.float16)
CUDA_HEAD_DIMS = (64, 128)
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_int(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class KernelLimits:
    """What one backend's kernels run on: the device type (None: any), dtypes and head dims, with the fix
    each refusal names."""

    device_type: str | None
    dtypes: tuple
    dtype_fix: str
    head_dims: Callable[[int], bool] | None = None  # None: any head dim
    head_dims_text: str = ""


KERNEL_LIMITS = {
    "reference": KernelLimits(None, REFERENCE_DTYPES, "cast to one of them"),
    "cpu": KernelLimits("cpu", CPU_DTYPES, "use backend='reference' or upcast", lambda d: d <= 256, "max 256"),
    "cuda": KernelLimits("cuda", CUDA_DTYPES, "cast to one of them or use backend='reference'",
                         lambda d: d in CUDA_HEAD_DIMS, f"supported: {CUDA_HEAD_DIMS}"),
}


def choose_backend(requested: str, *, device: torch.device | str, dtype: torch.dtype,
                   head_dim: int | None = None) -> str:
    """The concrete backend ("reference", "cpu" or "cuda") that `requested` runs on for tensors of this
    device and dtype (and head dim, when given): "auto" is "cuda" on a CUDA device and "cpu" on a
    CPU. Raises when that backend cannot run them, naming what to use instead: TypeError for a dtype,
    ValueError for anything else. `attention` decides its backend by this rule, so asking here
    before building any tensor gives the answer `attention` would."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    backend = requested
    if backend == "auto":
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='auto' has no kernel for device {device}; "
                             "use backend='reference'")
        backend = "cuda" if device.type == "cuda" else "cpu"
    limits = KERNEL_LIMITS[backend]
    if limits.device_type is not None and device.type != limits.device_type:
        raise ValueError(f"backend {backend!r} needs {limits.device_type.upper()} tensors, got device {device}; "
                         "use backend='auto' (the kernel of the device) or 'reference'")
    if dtype not in limits.dtypes:
        raise TypeError(f"dtype {dtype} unsupported by backend {backend!r} "
                        f"(supported: {limits.dtypes}; {limits.dtype_fix})")
    if head_dim is not None and limits.head_dims is not None and not limits.head_dims(head_dim):
        raise ValueError(f"head dim {head_dim} unsupported by backend {backend!r} ({limits.head_dims_text}); "
                         "use backend='reference'")
    return backend


def _validate(q, k, v, causal, scale, window, q_offset, k_offset, backend) -> str:
    """Check every argument; return the concrete backend. Errors name the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [B, H, N, D], got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(t.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k {tuple(k.shape)} vs v {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v devices differ: q {q.device}, k {k.device}, v {v.device}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k batch sizes differ: q {q.shape[0]} vs k {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ: q {q.shape[3]} vs k {k.shape[3]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be finite and > 0, got {scale}")
    _check_int("window", window)
    if window > 0 and not causal:
        raise ValueError("window > 0 requires causal=True (a sliding window is causal)")
    _check_int("q_offset", q_offset, allow_none=True)
    _check_int("k_offset", k_offset)

    return choose_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              scale: float | None = None, window: int = 0, q_offset: int | None = None,
              k_offset: int = 0, backend: str = "auto") -> torch.Tensor:
    """Softmax attention o [B, Hq, Nq, D]; twice differentiable on every backend."""
    backend = _validate(q, k, v, causal, scale, window, q_offset, k_offset, backend)
    num_q, num_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if q_offset is None:
        q_offset = default_q_offset(num_q, num_k, k_offset)
    if backend == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale, window=int(window),
                                   q_offset=int(q_offset), k_offset=int(k_offset))
    from .function import AttnFunc  # lazy: keeps import free of builds and CUDA probing

    return AttnFunc.apply(q, k, v, backend, causal, scale, int(window), int(q_offset),
                          int(k_offset))
