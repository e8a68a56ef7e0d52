"""The CUDA kernels' logic, run on the CPU by an emulator, vs the reference (no GPU needed).

    .venv/bin/python -m pytest tests/unit/test_flashbob_cuda_emu.py -q

csrc/emu/cuda_emu.h compiles csrc/flashbob_cuda_kernel.cu (kernels *and* launchers, unchanged)
as C++: one host thread per CUDA thread, std::barrier for __syncthreads, shuffles through shared
scratch, a guard region after shared memory. So indexing, masking, tile skipping, the GQA column
pass, synchronisation and the fp32 math of the BoB are checked here; warp timing and speed are
not (tests/ops/test_flashbob_cuda.py does that on a GPU). Same derived tolerance as the GPU
tests: error vs float64 <= k x (the reference's own bf16/fp16 error) + a few ulps.
The emulator is slow (256 threads per block), so the shapes are small.
"""

import pytest
import torch

from tests.unit.flashbob_cases import (FACTORS, NAMES, derived_tol, make_inputs, max_err,
                                       second_order)

EMU_CASES = [
    # (id, B, Hq, Hkv, Nq, Nk, D, kwargs, dtype)
    ("gqa_window_offsets_bf16", 1, 2, 1, 70, 90, 64, dict(causal=True, window=40, k_offset=5),
     torch.bfloat16),
    ("masked_rows_d128_bf16", 1, 1, 1, 50, 70, 128, dict(causal=True, q_offset=0, k_offset=20),
     torch.bfloat16),
    ("noncausal_fp16", 1, 2, 2, 40, 70, 64, dict(causal=False), torch.float16),
    ("batch2_causal_bf16", 2, 1, 1, 66, 66, 64, dict(causal=True), torch.bfloat16),
]


def _check(case, pattern=(1, 1, 1)):
    _, B, Hq, Hkv, Nq, Nk, D, kw, dtype = case
    inputs = make_inputs(B, Hq, Hkv, Nq, Nk, D, seed=7)
    ref64 = second_order(inputs, backend="reference", dtype=torch.float64, pattern=pattern, **kw)
    ref_lp = second_order(inputs, backend="reference", dtype=dtype, pattern=pattern, **kw)
    emu = second_order(inputs, backend="cuda_emu", dtype=dtype, pattern=pattern, **kw)
    for n in NAMES:
        assert torch.isfinite(emu[n]).all(), n
        err, err_ref = max_err(emu[n], ref64[n]), max_err(ref_lp[n], ref64[n])
        assert err <= derived_tol(err_ref, ref64[n], dtype, FACTORS[n]), (n, err, err_ref)
    return emu


@pytest.mark.parametrize("case", EMU_CASES, ids=[c[0] for c in EMU_CASES])
def test_emulated_cuda_kernels_match_reference(case):
    out = _check(case)
    if case[0].startswith("masked_rows"):  # rows 0..19 see no key: exact zeros
        for n in ("o", "dq", "qbar", "dobar"):
            assert torch.count_nonzero(out[n][:, :, :20]) == 0, n


@pytest.mark.parametrize("pattern", [(1, 0, 0), (0, 1, 0), (0, 0, 1)],
                         ids=lambda p: "uq%d_uk%d_uv%d" % p)
def test_emulated_cuda_zero_tangents(pattern):
    case = ("tiny", 1, 2, 1, 40, 50, 64, dict(causal=True, window=30), torch.bfloat16)
    out = _check(case, pattern)
    if pattern == (0, 0, 1):
        assert torch.count_nonzero(out["vbar"]) == 0
