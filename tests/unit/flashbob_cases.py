"""Shared cases and helpers for the FlashBoB tests (CPU tests here, GPU tests in tests/ops/).

`second_order(...)` runs the full second-order step on one backend and returns the eight tensors
the tests compare: o, dQ, dK, dV (first backward with create_graph=True) and Q̄, K̄, V̄, dŌ
(gradient of Φ = Σ <U_X, dX> over the given tangents). Tolerances are derived, never absolute:
`derived_tol` compares a kernel's low-precision error with the reference's own error at the
same precision (both measured against the float64 reference), FA-style.
"""

from __future__ import annotations

import torch

from ds_ttt.ops.flashbob import attention

NAMES = ("o", "dq", "dk", "dv", "qbar", "kbar", "vbar", "dobar")

# (id, B, Hq, Hkv, Nq, Nk, D, kwargs). Sizes are deliberately not tile (64) multiples except one.
CASES = [
    ("causal", 1, 2, 2, 100, 100, 16, dict(causal=True)),
    ("noncausal", 1, 2, 2, 70, 90, 40, dict(causal=False)),
    ("window", 1, 2, 2, 130, 130, 16, dict(causal=True, window=17)),
    ("gqa", 1, 4, 2, 80, 80, 64, dict(causal=True)),
    ("mqa", 1, 3, 1, 75, 75, 16, dict(causal=True)),
    ("mqa_window", 1, 4, 1, 90, 90, 8, dict(causal=True, window=33)),
    ("rect_offsets", 1, 2, 1, 40, 140, 16, dict(causal=True, q_offset=100, k_offset=5)),
    ("rect_right_aligned", 1, 2, 2, 30, 100, 16, dict(causal=True, k_offset=7)),
    ("more_queries_than_keys", 1, 2, 1, 90, 40, 16, dict(causal=True)),  # q_offset < 0
    ("masked_rows", 1, 2, 2, 50, 60, 16, dict(causal=True, q_offset=0, k_offset=20)),
    ("masked_rows_window", 1, 2, 1, 70, 70, 16, dict(causal=True, window=5, q_offset=0, k_offset=30)),
    ("batch", 3, 2, 1, 65, 65, 16, dict(causal=True)),
    ("tile_multiple", 2, 2, 2, 128, 128, 64, dict(causal=True, scale=0.3)),
]

# (uq, uk, uv) present? Every non-empty pattern.
TANGENT_PATTERNS = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, 1, 1)]


def make_inputs(B, Hq, Hkv, Nq, Nk, D, seed=0):
    """float64 q, k, v, dO and tangents U_Q, U_K, U_V (on CPU)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(q=r(B, Hq, Nq, D), k=r(B, Hkv, Nk, D), v=r(B, Hkv, Nk, D), do=r(B, Hq, Nq, D),
                uq=r(B, Hq, Nq, D), uk=r(B, Hkv, Nk, D), uv=r(B, Hkv, Nk, D))


def second_order(inputs, *, backend, dtype, device="cpu", pattern=(1, 1, 1), **kw):
    """The eight outputs (float64 on CPU) of forward, first grad and second grad."""
    q, k, v, do = (inputs[n].to(device=device, dtype=dtype).requires_grad_(True)
                   for n in ("q", "k", "v", "do"))
    if backend == "cuda_emu":  # the CUDA kernels run by the CPU emulator (not a public backend)
        o = _emulated_cuda_attention(q, k, v, **kw)
    else:
        o = attention(q, k, v, backend=backend, **kw)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    phi = sum((g * inputs[n].to(device=device, dtype=dtype)).sum()
              for g, n, used in zip((dq, dk, dv), ("uq", "uk", "uv"), pattern) if used)
    second = torch.autograd.grad(phi, (q, k, v, do), allow_unused=True)
    second = [torch.zeros_like(t) if s is None else s for s, t in zip(second, (q, k, v, do))]
    return {n: t.detach().to("cpu", torch.float64)
            for n, t in zip(NAMES, (o, dq, dk, dv, *second))}


def _emulated_cuda_attention(q, k, v, *, causal=True, scale=None, window=0, q_offset=None,
                             k_offset=0):
    from ds_ttt.ops.flashbob.function import AttnFunc
    from ds_ttt.ops.flashbob.reference import default_q_offset

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q_offset is None:
        q_offset = default_q_offset(q.shape[2], k.shape[2], k_offset)
    return AttnFunc.apply(q, k, v, "cuda_emu", causal, scale, window, q_offset, k_offset)


def max_err(a, b):
    return (a - b).abs().max().item()


# Allowed multiple of the reference's own low-precision error: FA's rule is 2x for outputs and
# 2-3x for first-order grads; second-order outputs go through one more level of recomputed
# products and partly cancelling sums (Q̄ = τ(Ω − E°∘B) − α∘dQ, S̄ = P∘(P̄ − E)), so 4x.
FACTORS = dict(o=2.0, dq=3.0, dk=3.0, dv=3.0, qbar=4.0, kbar=4.0, vbar=4.0, dobar=4.0)


def derived_tol(err_ref_lowprec, ref64, dtype, factor=2.0):
    """Kernel error allowed: factor × the reference's own low-precision error, plus a floor of a
    few units of `dtype` rounding at the output's magnitude (so exact-zero outputs still pass)."""
    floor = 4 * torch.finfo(dtype).eps * max(ref64.abs().max().item(), 1e-30)
    return factor * err_ref_lowprec + floor
