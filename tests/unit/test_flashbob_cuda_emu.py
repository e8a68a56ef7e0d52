"""The tensor-core CUDA kernels, run on the CPU by the emulator, vs the reference (no GPU needed).

    .venv/bin/python -m pytest tests/unit/test_flashbob_cuda_emu.py -q

csrc/emu/ compiles csrc/flashbob_cuda_kernel.cu (kernels *and* launchers, unchanged) as C++: one
host thread per CUDA thread, ldmatrix / mma.sync m16n8k16 / cp.async executed with the PTX ISA's
fragment layouts (csrc/emu/mma_emu.h; cp.async data is poison until its wait). So fragment
indexing, the cp.async double buffer, masking, tile skipping, GQA head packing, the column
passes and the fp32 math of the BoB are all checked here; warp timing and speed are not
(tests/ops/test_flashbob_cuda.py runs the same kernels on a GPU).

Tolerance (the project's rule, same as the GPU tests): error vs float64 <= k x (the reference's own
bf16/fp16 error vs float64) + 4 ulps of the output's magnitude. The cases together cover bf16 and
fp16, head dims 64 and 128, causal / non-causal / window, explicit and right-aligned offsets,
rectangular shapes, MHA / GQA / MQA (G = 3 too), batch 2, fully masked rows (exact zeros) and keys
no query sees (exact zeros), full tiles and ragged edges, and the zero-tangent patterns.
The emulator is slow (one host thread per lane), so the shapes are small.
"""

import pytest
import torch

from ds_ttt.ops.flashbob.reference import default_q_offset, visibility_mask
from tests.unit.flashbob_cases import (FACTORS, NAMES, derived_tol, make_inputs, max_err,
                                       second_order)

EMU_CASES = [
    # (id, B, Hq, Hkv, Nq, Nk, D, kwargs, dtype)
    ("gqa_window_offsets_bf16", 1, 2, 1, 70, 90, 64, dict(causal=True, window=40, k_offset=5),
     torch.bfloat16),
    ("masked_rows_d128_bf16", 1, 1, 1, 50, 70, 128, dict(causal=True, q_offset=0, k_offset=20),
     torch.bfloat16),
    ("noncausal_gqa_full_tiles_d128_fp16", 1, 4, 2, 40, 64, 128, dict(causal=False),
     torch.float16),
    ("noncausal_fp16", 1, 2, 2, 40, 70, 64, dict(causal=False), torch.float16),
    ("batch2_causal_bf16", 2, 1, 1, 66, 66, 64, dict(causal=True), torch.bfloat16),
    ("mqa3_window_d128_fp16", 1, 3, 1, 45, 45, 128, dict(causal=True, window=20), torch.float16),
    ("rect_offsets_unseen_keys_d128_bf16", 1, 2, 1, 30, 100, 128,
     dict(causal=True, q_offset=60, k_offset=5), torch.bfloat16),
    ("masked_rows_window_gqa_fp16", 1, 2, 1, 40, 40, 64,
     dict(causal=True, window=5, q_offset=0, k_offset=20), torch.float16),
    ("more_queries_than_keys_bf16", 1, 2, 1, 60, 30, 64, dict(causal=True), torch.bfloat16),
]


def _mask(Nq, Nk, kw):
    q_off = kw.get("q_offset")
    k_off = kw.get("k_offset", 0)
    if q_off is None:
        q_off = default_q_offset(Nq, Nk, k_off)
    return visibility_mask(Nq, Nk, causal=kw.get("causal", True), window=kw.get("window", 0),
                           q_offset=q_off, k_offset=k_off)


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
    _, _, _, _, Nq, Nk, _, kw, _ = case
    mask = _mask(Nq, Nk, kw)
    blind_rows, unseen_keys = ~mask.any(1), ~mask.any(0)
    for n in ("o", "dq", "qbar", "dobar"):  # rows that see no key: exact zeros
        assert torch.count_nonzero(out[n][:, :, blind_rows]) == 0, n
    for n in ("dk", "dv", "kbar", "vbar"):  # keys that no row sees: exact zeros
        assert torch.count_nonzero(out[n][:, :, unseen_keys]) == 0, n


def test_emulated_cases_cover_every_feature():
    """The case list itself: every feature the op supports appears at least once."""
    def has(pred):
        return any(pred(*c[1:]) for c in EMU_CASES)

    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            assert has(lambda B, Hq, Hkv, Nq, Nk, d, kw, dt: d == D and dt == dtype), (D, dtype)
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: not kw["causal"])
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: kw.get("window", 0) > 0)
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: Hkv == 1 and Hq == 3)          # MQA, G = 3
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: 1 < Hkv < Hq)                 # GQA
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: "q_offset" in kw)             # explicit
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: "q_offset" not in kw and Nq != Nk)
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: B > 1)
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: bool((~_mask(Nq, Nk, kw).any(1)).any()))
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: bool((~_mask(Nq, Nk, kw).any(0)).any()))


@pytest.mark.parametrize("pattern", [(1, 0, 0), (0, 1, 0), (0, 0, 1)],
                         ids=lambda p: "uq%d_uk%d_uv%d" % p)
def test_emulated_cuda_zero_tangents(pattern):
    case = ("tiny", 1, 2, 1, 40, 50, 64, dict(causal=True, window=30), torch.bfloat16)
    out = _check(case, pattern)
    if pattern == (0, 0, 1):
        assert torch.count_nonzero(out["vbar"]) == 0


def test_emulated_launchers_name_the_kernel_they_enqueued_last():
    """The CUDA binding's launch errors name this kernel (flashbob::last_launched_kernel): each
    launcher must leave its own last kernel there, so a fault is pinned on one of the six."""
    from ds_ttt.ops.flashbob.builder import load_cuda_emu_op

    op = load_cuda_emu_op()
    q, k, v, do = (torch.randn(1, 2, 20, 64).to(torch.bfloat16) for _ in range(4))
    o, stats = op.fwd(q, k, v, True, 0, 0, 0, 0.125)
    assert op.last_launched_kernel() == "fwd_kernel"
    dq, _, _ = op.bwd(q, k, v, o, stats, do, True, 0, 0, 0, 0.125)
    assert op.last_launched_kernel() == "bwd_col_kernel"
    op.bwd_bwd(q, k, v, o, stats, do, dq, q, k, v, True, 0, 0, 0, 0.125)
    assert op.last_launched_kernel() == "bob_col_kernel"
