"""CPU backend of FlashBoB vs the PyTorch reference: forward, first backward, BoB; gradgradcheck.

    .venv/bin/python -m pytest tests/unit/test_flashbob_cpu.py -q

The first test builds the C++ extension (~40 s cold, cached in TORCH_EXTENSIONS_DIR).
float64: cpu must match the float64 reference to ~1e3 ulps of the output magnitude.
float32: cpu's error vs the float64 reference must be <= k x the reference's own float32 error
(+ a few float32 ulps of the magnitude) for every one of the eight outputs; k = 2 for the
output, 3 for first-order grads, 4 for second-order outputs (flashbob_cases.FACTORS).
"""

import pytest
import torch

from ds_ttt.ops.flashbob import attention
from tests.unit.flashbob_cases import (CASES, FACTORS, NAMES, TANGENT_PATTERNS, derived_tol, make_inputs,
                                       max_err, second_order)


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_cpu_matches_reference_float64(case):
    _, B, Hq, Hkv, Nq, Nk, D, kw = case
    inputs = make_inputs(B, Hq, Hkv, Nq, Nk, D)
    ref = second_order(inputs, backend="reference", dtype=torch.float64, **kw)
    cpu = second_order(inputs, backend="cpu", dtype=torch.float64, **kw)
    for n in NAMES:
        tol = 1e3 * torch.finfo(torch.float64).eps * max(ref[n].abs().max().item(), 1.0)
        assert max_err(cpu[n], ref[n]) <= tol, (n, max_err(cpu[n], ref[n]), tol)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_cpu_float32_error_within_reference_float32_error(case):
    _, B, Hq, Hkv, Nq, Nk, D, kw = case
    inputs = make_inputs(B, Hq, Hkv, Nq, Nk, D, seed=1)
    ref64 = second_order(inputs, backend="reference", dtype=torch.float64, **kw)
    ref32 = second_order(inputs, backend="reference", dtype=torch.float32, **kw)
    cpu32 = second_order(inputs, backend="cpu", dtype=torch.float32, **kw)
    for n in NAMES:
        err_cpu, err_ref = max_err(cpu32[n], ref64[n]), max_err(ref32[n], ref64[n])
        tol = derived_tol(err_ref, ref64[n], torch.float32, FACTORS[n])
        assert err_cpu <= tol, (n, err_cpu, err_ref, tol)


@pytest.mark.parametrize("pattern", TANGENT_PATTERNS, ids=lambda p: "uq%d_uk%d_uv%d" % p)
def test_cpu_zero_tangent_patterns(pattern):
    inputs = make_inputs(1, 4, 2, 70, 90, 16, seed=2)
    kw = dict(causal=True, window=40)
    ref = second_order(inputs, backend="reference", dtype=torch.float64, pattern=pattern, **kw)
    cpu = second_order(inputs, backend="cpu", dtype=torch.float64, pattern=pattern, **kw)
    for n in NAMES:
        tol = 1e3 * torch.finfo(torch.float64).eps * max(ref[n].abs().max().item(), 1.0)
        assert max_err(cpu[n], ref[n]) <= tol, (n, pattern)
    if pattern == (0, 0, 1):  # U_Q = U_K = 0  =>  alpha = 0 and V̄ is exactly zero
        assert torch.count_nonzero(cpu["vbar"]) == 0


def test_cpu_fully_masked_rows_are_exact_zeros():
    # Queries at absolute positions 0..49 and keys at 20..79: rows 0..19 see nothing.
    inputs = make_inputs(1, 2, 1, 50, 60, 16, seed=3)
    out = second_order(inputs, backend="cpu", dtype=torch.float32, causal=True, q_offset=0,
                       k_offset=20)
    for n in ("o", "dq", "qbar", "dobar"):
        assert torch.isfinite(out[n]).all(), n
        assert torch.count_nonzero(out[n][:, :, :20]) == 0, n
        assert torch.count_nonzero(out[n][:, :, 20:]) > 0, n


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False),
                                dict(causal=True, window=3, q_offset=2, k_offset=0),
                                dict(causal=True, q_offset=0, k_offset=3)],
                         ids=["causal", "noncausal", "window_offsets", "masked_rows"])
def test_cpu_gradcheck_and_gradgradcheck_float64(kw):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return attention(q, k, v, backend="cpu", **kw)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_cpu_third_derivative_raises():
    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    o = attention(q, k, v, backend="cpu")
    (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    (qbar,) = torch.autograd.grad(dq.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="third derivative"):
        torch.autograd.grad(qbar.sum(), q, retain_graph=True)
    with pytest.raises(RuntimeError, match="third derivative"):
        qbar.sum().backward()


def test_auto_uses_cpu_kernel_for_cpu_tensors():
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    o = attention(q, k, v)
    assert type(o.grad_fn).__name__ == "AttnFuncBackward"
    ref = attention(q, k, v, backend="reference")
    assert type(ref.grad_fn).__name__ != "AttnFuncBackward"
    assert max_err(o.detach(), ref.detach()) <= 16 * torch.finfo(torch.float32).eps


def test_cpu_accepts_non_contiguous_inputs_and_grads_reach_them():
    base = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    q = base.transpose(1, 2).requires_grad_(True)  # [1, 2, 6, 8] non-contiguous leaf
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    o1 = attention(q, k, v, backend="cpu")
    o2 = attention(q, k, v, backend="reference")
    g1 = torch.autograd.grad(o1.sum(), q, create_graph=True)[0]
    g2 = torch.autograd.grad(o2.sum(), q, create_graph=True)[0]
    h1 = torch.autograd.grad(g1.square().sum(), (q, k))
    h2 = torch.autograd.grad(g2.square().sum(), (q, k))
    for a, b in zip((o1, g1, *h1), (o2, g2, *h2)):
        assert max_err(a.detach(), b.detach()) <= 1e-12
