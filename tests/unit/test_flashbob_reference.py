"""The FlashBoB reference (the specification) against float64 finite differences and basics.

    .venv/bin/python -m pytest tests/unit/test_flashbob_reference.py -q
"""

import pytest
import torch

from ds_ttt.ops.flashbob import attention, visibility_mask
from ds_ttt.ops.flashbob.reference import attention_reference

KWARGS = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window=3),
    dict(causal=True, q_offset=4, k_offset=1),          # rectangular, explicit offsets
    dict(causal=True, k_offset=2),                      # right-aligned default
    dict(causal=True, q_offset=0, k_offset=3),          # first rows fully masked
    dict(causal=True, window=2, q_offset=0, k_offset=2),
]
SHAPES = [(1, 2, 2, 6, 6, 4), (2, 4, 2, 5, 8, 3), (1, 3, 1, 4, 7, 4)]  # MHA, GQA, MQA


def _inputs(B, Hq, Hkv, Nq, Nk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                 for s in ((B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))


@pytest.mark.parametrize("shape", SHAPES, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kw", KWARGS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_reference_matches_finite_differences(shape, kw):
    q, k, v = _inputs(*shape)

    def f(q, k, v):
        return attention(q, k, v, backend="reference", **kw)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_reference_equals_explicit_per_head_softmax():
    q, k, v = _inputs(2, 4, 2, 5, 9, 3, seed=1)
    out = attention_reference(q, k, v, causal=True, window=4, q_offset=5, k_offset=1, scale=0.7)
    mask = visibility_mask(5, 9, causal=True, window=4, q_offset=5, k_offset=1)
    for b in range(2):
        for h in range(4):
            s = 0.7 * q[b, h] @ k[b, h // 2].T
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            torch.testing.assert_close(out[b, h], p @ v[b, h // 2], rtol=1e-12, atol=1e-12)


def test_visibility_mask_semantics():
    m = visibility_mask(3, 6, causal=True, window=2, q_offset=3, k_offset=0)
    # row i (abs 3+i) sees j iff 0 <= (3+i) - j < 2  ->  j in {2+i, 3+i}
    expected = torch.zeros(3, 6, dtype=torch.bool)
    for i in range(3):
        expected[i, 2 + i] = expected[i, 3 + i] = True
    assert torch.equal(m, expected)
    assert visibility_mask(2, 3, causal=False, window=0, q_offset=0, k_offset=9).all()


def test_reference_fully_masked_rows_are_zero_without_nan():
    q, k, v = _inputs(1, 2, 1, 6, 5, 4, seed=2)
    o = attention(q, k, v, backend="reference", q_offset=0, k_offset=2)  # rows 0,1 see nothing
    assert torch.count_nonzero(o[:, :, :2]) == 0 and torch.count_nonzero(o[:, :, 2:]) > 0
    dq, dk, dv = torch.autograd.grad(o.square().sum(), (q, k, v), create_graph=True)
    second = torch.autograd.grad((dq.sum() + dk.sum() + dv.sum()), (q, k, v))
    for t in (dq, dk, dv, *second):
        assert torch.isfinite(t).all()
    assert torch.count_nonzero(dq[:, :, :2]) == 0


def test_reference_lse_and_upcast():
    q, k, v = _inputs(1, 2, 2, 4, 4, 8, seed=3)
    o, lse = attention_reference(q, k, v, causal=True, q_offset=0, k_offset=1, return_lse=True)
    s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    mask = visibility_mask(4, 4, causal=True, window=0, q_offset=0, k_offset=1)
    expected = torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)
    assert torch.isinf(lse[:, :, 0]).all() and (lse[:, :, 0] > 0).all()  # fully masked: +inf
    torch.testing.assert_close(lse[:, :, 1:], expected[:, :, 1:])
    ob = attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), upcast=True)
    assert ob.dtype == torch.bfloat16
    err_up = (ob.double() - attention_reference(q, k, v)).abs().max()
    assert err_up <= 2 * torch.finfo(torch.bfloat16).eps * attention_reference(q, k, v).abs().max()
