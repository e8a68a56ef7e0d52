"""Every validation error of ds_ttt.ops.flashbob.attention names its argument.

    .venv/bin/python -m pytest tests/unit/test_flashbob_validation.py -q
"""

import pytest
import torch

from ds_ttt.ops.flashbob import attention


def _qkv(dtype=torch.float32, q_shape=(1, 4, 5, 8), kv_shape=(1, 2, 7, 8)):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), \
        torch.randn(kv_shape, dtype=dtype)


CASES = [
    # (id, (q, k, v) override, kwargs, exception, message regex)
    ("scale_zero", None, dict(scale=0.0), ValueError, "scale"),
    ("scale_negative", None, dict(scale=-1.0), ValueError, "scale"),
    ("scale_nan", None, dict(scale=float("nan")), ValueError, "scale"),
    ("scale_inf", None, dict(scale=float("inf")), ValueError, "scale"),
    ("scale_string", None, dict(scale="0.5"), TypeError, "scale"),
    ("scale_bool", None, dict(scale=True), TypeError, "scale"),
    ("window_negative", None, dict(window=-1), ValueError, "window"),
    ("window_float", None, dict(window=2.0), TypeError, "window"),
    ("window_bool", None, dict(window=True), TypeError, "window"),
    ("window_without_causal", None, dict(window=4, causal=False), ValueError, "window"),
    ("q_offset_negative", None, dict(q_offset=-1), ValueError, "q_offset"),
    ("q_offset_float", None, dict(q_offset=1.5), TypeError, "q_offset"),
    ("k_offset_negative", None, dict(k_offset=-3), ValueError, "k_offset"),
    ("k_offset_float", None, dict(k_offset=2.0), TypeError, "k_offset"),
    ("k_offset_bool", None, dict(k_offset=False), TypeError, "k_offset"),
    ("causal_int", None, dict(causal=1), TypeError, "causal"),
    ("kv_shape_mismatch", lambda: (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8),
                                   torch.randn(1, 2, 6, 8)), {}, ValueError, "k and v"),
    ("mixed_dtypes", lambda: (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8).double(),
                              torch.randn(1, 2, 7, 8).double()), {}, TypeError, "dtype"),
    ("heads_not_divisible", lambda: _qkv(q_shape=(1, 3, 5, 8)), {}, ValueError, "heads"),
    ("batch_mismatch", lambda: _qkv(q_shape=(2, 4, 5, 8)), {}, ValueError, "batch"),
    ("head_dim_mismatch", lambda: _qkv(q_shape=(1, 4, 5, 16)), {}, ValueError, "head dim"),
    ("rank_3", lambda: (torch.randn(4, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 8)), {},
     ValueError, "rank"),
    ("empty_dim", lambda: _qkv(q_shape=(1, 4, 0, 8)), {}, ValueError, "empty"),
    ("not_a_tensor", lambda: ([[1.0]], torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)), {},
     TypeError, "q must be a torch.Tensor"),
    ("device_mismatch", lambda: (torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8, device="meta"),
                                 torch.randn(1, 2, 7, 8, device="meta")), {}, ValueError,
     "device"),
    ("unknown_backend", None, dict(backend="triton"), ValueError, "backend"),
    ("cpu_backend_bf16", lambda: _qkv(torch.bfloat16), dict(backend="cpu"), TypeError,
     "dtype .*backend 'cpu'"),
    ("cpu_backend_head_dim", lambda: _qkv(q_shape=(1, 4, 5, 300), kv_shape=(1, 2, 7, 300)),
     dict(backend="cpu"), ValueError, "head dim"),
    ("cuda_backend_on_cpu_tensors", None, dict(backend="cuda"), ValueError, "backend 'cuda'"),
    ("reference_int_dtype", lambda: tuple(torch.ones(1, 2, 3, 4, dtype=torch.int32)
                                          for _ in range(3)),
     dict(backend="reference"), TypeError, "dtype"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_validation_error(case):
    _, make, kw, exc, msg = case
    q, k, v = make() if make else _qkv()
    with pytest.raises(exc, match=msg):
        attention(q, k, v, **kw)


def test_valid_call_passes_validation_on_every_backend():
    q, k, v = _qkv(torch.float64)
    outs = [attention(q, k, v, backend=b, window=3, q_offset=2, k_offset=0, scale=0.5)
            for b in ("reference", "cpu", "auto")]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0])


# ---- choose_backend: the backend rule without a tensor (loading asks it before any attention call) ----
CHOICES = [
    # (requested, device, dtype, head_dim, concrete backend)
    ("auto", "cpu", torch.float32, 16, "cpu"),
    ("auto", "cuda", torch.bfloat16, 128, "cuda"),
    ("reference", "cpu", torch.bfloat16, 300, "reference"),
    ("reference", "meta", torch.float16, None, "reference"),
    ("cpu", "cpu", torch.float64, 256, "cpu"),
    ("cuda", "cuda:0", torch.float16, 64, "cuda"),
    ("cuda", torch.device("cuda"), torch.bfloat16, None, "cuda"),
]


@pytest.mark.parametrize("requested,device,dtype,head_dim,expected", CHOICES)
def test_choose_backend_names_the_concrete_backend(requested, device, dtype, head_dim, expected):
    from ds_ttt.ops.flashbob import choose_backend

    assert choose_backend(requested, device=device, dtype=dtype, head_dim=head_dim) == expected


REFUSALS = [
    # (requested, device, dtype, head_dim, exception, message regex: the problem, then the fix)
    ("triton", "cpu", torch.float32, None, ValueError, "backend must be one of .*'auto'"),
    ("auto", "meta", torch.float32, None, ValueError, "no kernel for device meta; use backend='reference'"),
    ("auto", "cpu", torch.bfloat16, None, TypeError, "backend 'cpu'.*use backend='reference' or upcast"),
    ("auto", "cuda", torch.float32, None, TypeError, "backend 'cuda'.*use backend='reference'"),
    ("reference", "cpu", torch.int32, None, TypeError, "backend 'reference'.*cast to one of them"),
    ("cpu", "cuda", torch.float32, None, ValueError, "needs CPU tensors.*use backend='auto'.*or 'reference'"),
    ("cpu", "cpu", torch.float16, None, TypeError, "backend 'cpu'.*use backend='reference' or upcast"),
    ("cpu", "cpu", torch.float32, 300, ValueError, "head dim 300.*max 256.*use backend='reference'"),
    ("cuda", "cpu", torch.bfloat16, 64, ValueError, "needs CUDA tensors.*use backend='auto'.*or 'reference'"),
    ("cuda", "cuda", torch.bfloat16, 32, ValueError, "head dim 32.*use backend='reference'"),
]


@pytest.mark.parametrize("requested,device,dtype,head_dim,exc,msg", REFUSALS)
def test_choose_backend_refusal_names_the_fix(requested, device, dtype, head_dim, exc, msg):
    from ds_ttt.ops.flashbob import choose_backend

    with pytest.raises(exc, match=msg):
        choose_backend(requested, device=device, dtype=dtype, head_dim=head_dim)


def test_attention_decides_its_backend_by_choose_backend(monkeypatch):
    """One rule: attention's argument check asks choose_backend with its tensors' device, dtype and head dim."""
    import ds_ttt.ops.flashbob as flashbob

    asked = []
    real = flashbob.choose_backend

    def spy(requested, **kw):
        asked.append((requested, kw))
        return real(requested, **kw)

    monkeypatch.setattr(flashbob, "choose_backend", spy)
    q, k, v = _qkv(torch.float64)
    attention(q, k, v, backend="auto")
    assert asked == [("auto", dict(device=q.device, dtype=torch.float64, head_dim=8))]
