"""The CPU emulation of the tensor-core primitives (csrc/emu/mma_emu.h) against the PTX ISA's
fragment tables and plain matrix products, through the probe kernels (csrc/mma_probe.cu).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/unit/test_mma_emu.py -q

Per instruction: ldmatrix x1/x2/x4 with and without .trans (scattered row addresses, distinct
values: every lane's registers against the ISA layout), mma.sync m16n8k16 bf16/f16 (registers
built from the ISA layout; D against A·B + C of the rounded inputs in float64, rounded once; also
with d aliasing c), ldmatrix feeding mma (against torch's matmul, no layout involved), cp.async
with commit/wait groups and zero fill (completed data exact, pending data poisoned), the
bf16x2/f16x2 packing (round-to-nearest-even, against torch's conversions), and the emulator's
loud failures on misuse (diverged lanes, mixed instructions, bad addresses, deadlock).
Blocks of 64 threads (two warps) check that warps see only their own operands.
The same probe runs on a GPU in tests/ops/test_mma_probe_cuda.py, which must match lane by lane.
"""

import pytest
import torch

from ds_ttt.ops.flashbob.probe_builder import load_probe_emu
from tests.unit import mma_probe_cases as mc


@pytest.fixture(scope="module")
def probe():
    return mc.Probe(load_probe_emu(), "cpu")


@pytest.mark.parametrize("variant", sorted(mc.LDMATRIX_VARIANTS),
                         ids=lambda v: "x%d%s" % (mc.LDMATRIX_VARIANTS[v][0],
                                                  ".trans" if mc.LDMATRIX_VARIANTS[v][1] else ""))
def test_ldmatrix_matches_isa_layout(probe, variant):
    case = mc.ldmatrix_case(variant, nthreads=64, seed=variant)
    out_u, _ = probe.run_case(case)
    expected = mc.ldmatrix_expected_all(case)
    assert torch.equal(out_u, expected), (out_u.reshape(-1, 4)[:4], expected.reshape(-1, 4)[:4])


def test_ldmatrix_trans_is_transpose_of_plain(probe):
    """Independent of the lane tables: with the 8 rows of one matrix at consecutive addresses,
    .trans of M must deliver what the plain load delivers for M^T."""
    gen = torch.Generator().manual_seed(3)
    M = torch.randn(8, 8, generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([8 * (lane % 8) for lane in range(32)], dtype=torch.int32)
    regs = []
    for variant, mat in ((3, M), (0, M.t().contiguous())):
        case = mc.Case(mc.LDMATRIX, variant, 32, src16=mat.reshape(-1).view(torch.int16),
                       offsets=offsets, n_out_u=128)
        regs.append(probe.run_case(case)[0].reshape(32, 4)[:, 0])
    assert torch.equal(regs[0], regs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("alias", [False, True], ids=["d_new", "d_is_c"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact_sums", "random"])
def test_mma_matches_matrix_product(probe, dtype, alias, exact):
    case = mc.mma_case(dtype, alias, nthreads=64, seed=11, exact=exact)
    _, out_f = probe.run_case(case)
    lanes = out_f.reshape(-1, 32, 4)
    for w, (A, B, C) in enumerate(case.info["mats"]):
        D = mc.c_matrix(lanes[w])
        ref = mc.mma_reference(A, B, C)
        assert torch.equal(D, ref), (w, (D - ref).abs().max())
        if exact:  # exact partial sums: fp32 matmul of the rounded inputs agrees bit for bit
            assert torch.equal(D, A.float() @ B.float() + C)


def test_mma_layouts_are_not_symmetric(probe):
    """A wrong A/B/C table would still pass with symmetric data; this one cannot: D = E_rc B picks
    row c of B into row r of D, for every (r, c)."""
    B = (torch.arange(128, dtype=torch.float32).reshape(16, 8) / 8).to(torch.bfloat16)
    for r, c in ((0, 0), (3, 9), (8, 5), (15, 15), (9, 2)):
        A = torch.zeros(16, 16, dtype=torch.bfloat16)
        A[r, c] = 1
        in_u = torch.cat([mc.a_registers(A), mc.b_registers(B)], dim=1).reshape(-1)
        case = mc.Case(mc.MMA, 0, 32, in_u=in_u, in_f=torch.zeros(128), n_out_f=128)
        D = mc.c_matrix(probe.run_case(case)[1].reshape(32, 4))
        expected = torch.zeros(16, 8)
        expected[r] = B[c].float()
        assert torch.equal(D, expected), (r, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("b_stored_kn", [False, True], ids=["B_nk_ldmatrix", "B_kn_ldmatrix_trans"])
def test_ldmatrix_then_mma_is_a_matmul(probe, dtype, b_stored_kn):
    case = mc.ldmatrix_mma_case(dtype, b_stored_kn, nthreads=64, seed=5)
    _, out_f = probe.run_case(case)
    for w, (A, B) in enumerate(case.info["mats"]):
        D = out_f[w * 128:(w + 1) * 128].reshape(16, 8)
        ref = (A.double() @ B.double()).float()
        assert torch.equal(D, ref), (w, (D - ref).abs().max())
        # and against a plain fp32 matmul of the rounded inputs, within fp32 summation error
        torch.testing.assert_close(D, A.float() @ B.float(), rtol=0, atol=16 * 2**-23 * (
            A.float().abs() @ B.float().abs()).max().item())


@pytest.mark.parametrize("variant", sorted(mc.CP_ASYNC_VARIANTS), ids=lambda v: mc.CP_ASYNC_VARIANTS[v])
def test_cp_async_groups_waits_and_zfill(probe, variant):
    case = mc.cp_async_case(nthreads=64, seed=2, variant=variant)
    out_u, _ = probe.run_case(case)
    snaps = out_u.reshape(4, -1)
    expected, done = mc.cp_async_expected(case)
    for k in range(4):
        assert torch.equal(snaps[k][done[k]], expected[k][done[k]]), k
        pending = snaps[k][~done[k]]
        assert torch.all(pending == mc.POISON_WORD), (k, pending[:8])  # emulator: poison until wait
    assert (~done[0]).sum() == 2 * 64 * 4 and (~done[1]).sum() == 64 * 4 and done[2].all()
    zero_chunks = expected[2].reshape(-1, 4)[64:].eq(0).all(dim=1).sum()
    assert zero_chunks >= 2 * 64 // 5  # the zero fill really happened


def test_read_before_wait_sees_poison(probe):
    out_u, _ = probe.run_case(mc.misuse_case(mc.READ_EARLY, nthreads=64))
    assert torch.all(out_u == mc.POISON_WORD)


def test_pack_round_to_nearest_even(probe):
    case = mc.pack_case()
    out_u, out_f = probe.run_case(case)
    exp_u, exp_f = mc.pack_expected(case)
    assert torch.equal(out_u, exp_u)
    assert torch.equal(out_f, exp_f)
    # spot checks written out: 1 + 2^-8 is a bf16 tie -> 1.0 (even); 65520 overflows f16 to inf
    bf_lo = mc.to_u32(out_u[0::2]) & 0xFFFF
    assert int(bf_lo[1]) == 0x3F80  # pair (1 + 2^-8, 1 + 3*2^-8): low half 1.0
    assert out_f.reshape(-1, 4)[5, 3].item() == float("inf")  # pair 5 = (65519, 65520), f16 hi


@pytest.mark.parametrize("op, message", [
    (mc.BAD_DIVERGENT, "did not take part"),
    (mc.BAD_MIXED, "executes"),
    (mc.BAD_ADDRESS, "not 16-byte aligned shared memory"),
    (mc.BAD_ALIGN, "not 16-byte aligned shared memory"),
    (mc.BAD_DEADLOCK, "deadlock"),
], ids=["divergent", "mixed", "global_address", "misaligned", "deadlock"])
def test_misuse_fails_loudly(probe, op, message):
    with pytest.raises(RuntimeError, match=message):
        probe.run_case(mc.misuse_case(op, nthreads=64))
