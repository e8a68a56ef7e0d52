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

Tile sets (ds_ttt/ops/flashbob/tiles.py): every case runs with both default sets, each picked by
the launchers from the emulated device as on a GPU: "sm80" (64-row blocks of 4 warps) on an
emulated A100, "sm90" (128-row blocks of 8 warps, up to 188 KB of shared memory) on an emulated
H100. The sweep's sets (bf16, D = 128) run the D = 128 bf16 cases; the device rule and the
refusals are tested too.
"""

import contextlib

import pytest
import torch

from ds_ttt.ops.flashbob.builder import load_cuda_emu_op
from ds_ttt.ops.flashbob.reference import default_q_offset, visibility_mask
from ds_ttt.ops.flashbob.tiles import active_tile_set, tile_set, tile_sets, use_tile_set
from tests.unit.flashbob_cases import (FACTORS, NAMES, derived_tol, make_inputs, max_err,
                                       second_order)

# Emulated devices: (compute capability major, minor, opt-in shared memory per block in bytes).
A100, H100, RTX4090 = (8, 0, 163 * 1024), (9, 0, 227 * 1024), (8, 9, 99 * 1024)
DEFAULT_SETS = {"sm80": A100, "sm90": H100}  # the set each device picks by itself
SWEEP_SETS = ("sm80_half_bn", "sm90_half_bn")  # built for bf16 at D = 128, run on an H100


@contextlib.contextmanager
def emulated(device, set_name=None):
    """The emulated GPU `device` (and an explicit tile set) inside the block; an A100 after."""
    op = load_cuda_emu_op()
    op.set_emulated_device(*device)
    try:
        with use_tile_set(op, set_name):
            yield op
    finally:
        op.set_emulated_device(*A100)

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
    # two 128-key column blocks and two 128-row row blocks (the sm90 set's shapes), window
    ("two_128_blocks_window_d128_bf16", 1, 2, 1, 70, 150, 128, dict(causal=True, window=100),
     torch.bfloat16),
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


@pytest.mark.parametrize("set_name", sorted(DEFAULT_SETS))
@pytest.mark.parametrize("case", EMU_CASES, ids=[c[0] for c in EMU_CASES])
def test_emulated_cuda_kernels_match_reference(case, set_name):
    with emulated(DEFAULT_SETS[set_name]) as op:  # the device picks the set
        assert active_tile_set(op)["name"] == set_name
        out = _check(case)
    _, _, _, _, Nq, Nk, _, kw, _ = case
    mask = _mask(Nq, Nk, kw)
    blind_rows, unseen_keys = ~mask.any(1), ~mask.any(0)
    for n in ("o", "dq", "qbar", "dobar"):  # rows that see no key: exact zeros
        assert torch.count_nonzero(out[n][:, :, blind_rows]) == 0, n
    for n in ("dk", "dv", "kbar", "vbar"):  # keys that no row sees: exact zeros
        assert torch.count_nonzero(out[n][:, :, unseen_keys]) == 0, n


SWEEP_CASES = [c for c in EMU_CASES if c[6] == 128 and c[8] == torch.bfloat16]


@pytest.mark.parametrize("set_name", SWEEP_SETS)
@pytest.mark.parametrize("case", SWEEP_CASES, ids=[c[0] for c in SWEEP_CASES])
def test_emulated_sweep_tile_sets_match_reference(case, set_name):
    with emulated(H100, set_name) as op:
        assert active_tile_set(op)["name"] == set_name and active_tile_set(op)["overridden"]
        _check(case)


def test_tile_sets_shapes_and_the_device_rule():
    op = load_cuda_emu_op()
    sets = {s["name"]: s for s in tile_sets(op)}
    assert list(sets) == ["sm80", "sm90", "sm80_half_bn", "sm90_half_bn"]
    shape = {(n, x["kernel"], x["D"]): x for n, s in sets.items() for x in s["shapes"]}
    for k in ("bwd_row_kernel", "bwd_col_kernel", "bob_stats_kernel", "bob_row_kernel", "bob_col_kernel"):
        for D in (64, 128):
            a, b = shape[("sm80", k, D)], shape[("sm90", k, D)]
            assert (a["BM"], a["warps"], a["arch"]) == (64, 4, 800) and (b["BM"], b["warps"], b["arch"]) == (128, 8, 900)
            assert a["BN"] == b["BN"] and a["smem_bytes"] <= 163 * 1024 and b["smem_bytes"] <= 227 * 1024
            if k.startswith("bob") and D == 128:
                assert b["smem_bytes"] > 163 * 1024  # only an H100/H200 holds these
        for half, full in (("sm80_half_bn", "sm80"), ("sm90_half_bn", "sm90")):
            assert shape[(half, k, 128)]["BN"] * 2 == shape[(full, k, 128)]["BN"]
            assert (half, k, 64) not in shape and sets[half]["dtypes"] == ["bf16"]
    assert shape[("sm90", "fwd_kernel", 128)]["BM"] == 128 and shape[("sm90", "fwd_kernel", 128)]["warps"] == 8
    # the device decides: compute capability 9.0+ with 227 KB per block gets sm90, anything else sm80
    for device, expected in ((A100, "sm80"), (H100, "sm90"), (RTX4090, "sm80"), ((12, 0, 99 * 1024), "sm80"),
                             ((10, 0, 227 * 1024), "sm90")):
        with emulated(device) as op:
            assert active_tile_set(op) == {**sets[expected], "overridden": False}, device


def test_tile_set_refusals_name_the_reason():
    q = torch.randn(1, 2, 40, 64).to(torch.bfloat16)
    with emulated(A100, "sm90") as op, pytest.raises(RuntimeError, match="sm90 is compiled for sm_90 and later; "
                                                                           "this GPU is sm_80"):
        op.fwd(q, q, q, True, 0, 0, 0, 0.125)
    with emulated(H100, "sm90_half_bn") as op, pytest.raises(RuntimeError, match="bfloat16 at head dim 128 only"):
        op.fwd(q, q, q, True, 0, 0, 0, 0.125)
    # a default shape the device cannot hold is the launch's error, as on the GPU (no silent fallback)
    q128 = torch.randn(1, 1, 64, 128).to(torch.bfloat16)
    with emulated(RTX4090) as op, pytest.raises(RuntimeError, match="bwd_bwd failed"):
        o, stats = op.fwd(q128, q128, q128, True, 0, 0, 0, 0.125)
        op.bwd_bwd(q128, q128, q128, o, stats, q128, q128, q128, q128, q128, True, 0, 0, 0, 0.125)
    op = load_cuda_emu_op()
    with pytest.raises(ValueError, match="unknown tile set 'sm70'"):
        tile_set(op, "sm70")
    with pytest.raises(RuntimeError, match="no tile set 7"):
        op.set_tile_set(7)
    assert op.tile_set() == -1


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
    # more than one block of 128 packed rows and of 128 keys (the sm90 set's block size)
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: Nk > 128 and Nq * Hq // Hkv > 128)
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: bool((~_mask(Nq, Nk, kw).any(1)).any()))
    assert has(lambda B, Hq, Hkv, Nq, Nk, D, kw, dt: bool((~_mask(Nq, Nk, kw).any(0)).any()))


@pytest.mark.parametrize("pattern", [(1, 0, 0), (0, 1, 0), (0, 0, 1)],
                         ids=lambda p: "uq%d_uk%d_uv%d" % p)
@pytest.mark.parametrize("set_name", sorted(DEFAULT_SETS))
def test_emulated_cuda_zero_tangents(pattern, set_name):
    case = ("tiny", 1, 2, 1, 40, 50, 64, dict(causal=True, window=30), torch.bfloat16)
    with emulated(DEFAULT_SETS[set_name]):
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
