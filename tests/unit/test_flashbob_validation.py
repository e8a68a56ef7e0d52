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
