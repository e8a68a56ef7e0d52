"""Inputs and expected results for the tensor-core probe (csrc/mma_probe.cu), shared by the
emulator tests (tests/unit/test_mma_emu.py) and the GPU comparison (tests/ops/test_mma_probe_cuda.py).

The expected per-lane registers are computed here from the PTX ISA's fragment tables, written
out again in Python (section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point
type" and 9.7.14.5.15 "ldmatrix"), and the chained probe is checked against a plain matrix
product, which needs no layout at all. Registers travel as int32 tensors holding uint32 bits.

    from tests.unit.mma_probe_cases import Probe, ldmatrix_case
    probe = Probe(load_probe_emu(), "cpu")
    case = ldmatrix_case(variant=2, nthreads=64, seed=0)
    regs = probe.run_case(case)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Probe ids: csrc/mma_probe.h (ProbeOp).
LDMATRIX, MMA, LDMATRIX_MMA, CP_ASYNC, PACK = 0, 1, 2, 3, 4
BAD_DIVERGENT, BAD_MIXED, BAD_ADDRESS, BAD_ALIGN, READ_EARLY, BAD_DEADLOCK = (
    100, 101, 102, 103, 104, 105)

LDMATRIX_VARIANTS = {0: (1, False), 1: (2, False), 2: (4, False),
                     3: (1, True), 4: (2, True), 5: (4, True)}  # variant -> (num, trans)
POISON_WORD = -1  # 0xFFFFFFFF: what the emulator leaves in a cp.async destination until its wait
CP_ASYNC_ZFILL_SKIP = 3  # chunk % 5 == 3 is zero-filled in groups 1 and 2 (mma_probe.cu)

@dataclass
class Case:
    """One probe launch: its arguments and output sizes (tensors on the CPU)."""

    op: int
    variant: int
    nthreads: int
    src16: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int16))
    offsets: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    in_u: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    in_f: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    n_out_u: int = 0
    n_out_f: int = 0
    info: dict = field(default_factory=dict)


class Probe:
    """Runs cases on one build of the probe (the emulator's, on "cpu", or the GPU's, on "cuda")."""

    def __init__(self, module, device: str):
        self.module, self.device = module, device

    def run_case(self, case: Case):
        d = self.device
        out_u, out_f = self.module.run(case.op, case.variant, case.nthreads, case.src16.to(d),
                                       case.offsets.to(d), case.in_u.to(d), case.in_f.to(d),
                                       case.n_out_u, case.n_out_f)
        if d != "cpu":
            torch.cuda.synchronize()
        return out_u.cpu(), out_f.cpu()


# ---- bits and registers ------------------------------------------------------------------------

def bits16(x: torch.Tensor) -> torch.Tensor:
    """bf16/f16 tensor -> its 16-bit patterns as int64 in 0..65535."""
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def pack_pair(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two 16-bit patterns (int64) -> the uint32 register (lo in bits 0..15) as int32."""
    return to_i32(lo | (hi << 16))


def to_i32(u: torch.Tensor) -> torch.Tensor:
    u = u.to(torch.int64) & 0xFFFFFFFF
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def to_u32(i: torch.Tensor) -> torch.Tensor:
    return i.to(torch.int64) & 0xFFFFFFFF


# ---- PTX ISA 9.7.14.5.8: m16n8k16 .f16/.bf16 fragments, g = lane >> 2, t = lane % 4 -----------

def a_pos(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element a_i (i = 0..7) of lane's A fragment (16 x 16, row-major operand)."""
    g, t = lane >> 2, lane % 4
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = t * 2 + (i & 1) + (0 if i < 4 else 8)
    return row, col


def b_pos(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element b_i (i = 0..3) of lane's B fragment (16 x 8, column operand)."""
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (0 if i < 2 else 8), g


def c_pos(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element c_i / d_i (i = 0..3) of lane's f32 accumulator (16 x 8)."""
    g, t = lane >> 2, lane % 4
    return g + (0 if i < 2 else 8), t * 2 + (i & 1)


def a_registers(A: torch.Tensor) -> torch.Tensor:
    """(16, 16) bf16/f16 -> (32, 4) int32 registers; register j holds elements 2j, 2j + 1."""
    b = bits16(A)
    regs = torch.zeros(32, 4, dtype=torch.int32)
    for lane in range(32):
        for j in range(4):
            lo, hi = (b[a_pos(lane, 2 * j)], b[a_pos(lane, 2 * j + 1)])
            regs[lane, j] = pack_pair(lo, hi)
    return regs


def b_registers(B: torch.Tensor) -> torch.Tensor:
    """(16, 8) bf16/f16 -> (32, 2) int32 registers."""
    b = bits16(B)
    regs = torch.zeros(32, 2, dtype=torch.int32)
    for lane in range(32):
        for j in range(2):
            regs[lane, j] = pack_pair(b[b_pos(lane, 2 * j)], b[b_pos(lane, 2 * j + 1)])
    return regs


def c_lanes(C: torch.Tensor) -> torch.Tensor:
    """(16, 8) float32 -> (32, 4) per-lane accumulator values."""
    return torch.stack([torch.stack([C[c_pos(lane, i)] for i in range(4)]) for lane in range(32)])


def c_matrix(lanes: torch.Tensor) -> torch.Tensor:
    """(32, 4) per-lane accumulator values -> (16, 8) matrix (inverse of c_lanes)."""
    C = torch.full((16, 8), float("nan"), dtype=lanes.dtype)
    for lane in range(32):
        for i in range(4):
            C[c_pos(lane, i)] = lanes[lane, i]
    return C


# ---- PTX ISA 9.7.14.5.15: ldmatrix .m8n8 .b16 ---------------------------------------------------

def ldmatrix_expected(src_bits: torch.Tensor, offsets: torch.Tensor, num: int, trans: bool):
    """Registers every lane of one warp receives: (32, 4) int32 (unused registers 0).

    Lanes 8m..8m+7 address rows 0..7 of matrix m; lane L receives row L >> 2, elements
    2(L % 4) and 2(L % 4) + 1 of each matrix (low half first), or with .trans the elements
    (2(L % 4), L >> 2) and (2(L % 4) + 1, L >> 2) of the matrix as stored."""
    out = torch.zeros(32, 4, dtype=torch.int32)
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for m in range(num):
            rows = [int(offsets[8 * m + r]) for r in range(8)]
            if not trans:
                lo, hi = src_bits[rows[g] + 2 * t], src_bits[rows[g] + 2 * t + 1]
            else:
                lo, hi = src_bits[rows[2 * t] + g], src_bits[rows[2 * t + 1] + g]
            out[lane, m] = pack_pair(lo, hi)
    return out


def ldmatrix_case(variant: int, nthreads: int, seed: int) -> Case:
    """A 64 x 24 b16 buffer of distinct values; each lane addresses a random row at a random
    8-element column block (16-byte aligned), different per warp."""
    gen = torch.Generator().manual_seed(seed)
    rows, stride = 64, 24
    n16 = rows * stride
    src = (torch.randperm(65536, generator=gen)[:n16]).to(torch.int64)  # distinct bit patterns
    offsets = torch.empty(nthreads, dtype=torch.int32)
    for w in range(nthreads // 32):
        row = torch.randperm(rows, generator=gen)[:32]
        blk = torch.randint(0, stride // 8, (32,), generator=gen)
        offsets[32 * w:32 * w + 32] = (row * stride + blk * 8).to(torch.int32)
    src16 = torch.where(src >= 2**15, src - 2**16, src).to(torch.int16)
    return Case(LDMATRIX, variant, nthreads, src16=src16, offsets=offsets, n_out_u=nthreads * 4,
                info=dict(src_bits=src))


def ldmatrix_expected_all(case: Case) -> torch.Tensor:
    num, trans = LDMATRIX_VARIANTS[case.variant]
    parts = [ldmatrix_expected(case.info["src_bits"], case.offsets[32 * w:32 * w + 32], num, trans)
             for w in range(case.nthreads // 32)]
    return torch.cat(parts).reshape(-1)


# ---- mma ----------------------------------------------------------------------------------------

def mma_matrices(dtype, nwarps: int, seed: int, exact: bool):
    """Per warp A (16x16), B (16x8) in `dtype`, C (16x8) float32. With exact=True the values are
    small multiples of powers of two, so every partial sum is exact in fp32 (any summation order
    gives the same bits); otherwise random normals (rounded to dtype)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(nwarps):
        if exact:
            A = (torch.randint(-8, 9, (16, 16), generator=gen) * 0.25).to(dtype)
            B = (torch.randint(-8, 9, (16, 8), generator=gen) * 0.125).to(dtype)
            C = torch.randint(-64, 65, (16, 8), generator=gen).to(torch.float32) * 0.5
        else:
            A = torch.randn(16, 16, generator=gen).to(dtype)
            B = torch.randn(16, 8, generator=gen).to(dtype)
            C = torch.randn(16, 8, generator=gen).to(torch.float32)
        out.append((A, B, C))
    return out


def mma_reference(A, B, C) -> torch.Tensor:
    """D = A B + C from the rounded inputs, in float64 (exact products), rounded once to fp32."""
    return (A.double() @ B.double() + C.double()).to(torch.float32)


def mma_case(dtype, variant_alias: bool, nthreads: int, seed: int, exact: bool) -> Case:
    variant = (0 if dtype == torch.bfloat16 else 1) + (2 if variant_alias else 0)
    mats = mma_matrices(dtype, nthreads // 32, seed, exact)
    in_u = torch.cat([torch.cat([a_registers(A), b_registers(B)], dim=1) for A, B, _ in mats])
    in_f = torch.cat([c_lanes(C) for _, _, C in mats])
    return Case(MMA, variant, nthreads, in_u=in_u.reshape(-1).contiguous(),
                in_f=in_f.reshape(-1).contiguous(), n_out_f=nthreads * 4, info=dict(mats=mats))


def ldmatrix_mma_case(dtype, b_stored_kn: bool, nthreads: int, seed: int) -> Case:
    """Per warp, A (16x16 row-major) then B (N x K row-major, or K x N with b_stored_kn) in one
    512-element slice of src16; the probe loads them with ldmatrix and multiplies."""
    variant = (0 if dtype == torch.bfloat16 else 1) + (2 if b_stored_kn else 0)
    gen = torch.Generator().manual_seed(seed)
    slices, mats = [], []
    for _ in range(nthreads // 32):
        A = torch.randn(16, 16, generator=gen).to(dtype)
        B = torch.randn(16, 8, generator=gen).to(dtype)
        Bs = B if b_stored_kn else B.t()
        pad = torch.zeros(128, dtype=dtype)  # the probe's per-warp slice is 512 elements
        slices.append(torch.cat([A.reshape(-1), Bs.contiguous().reshape(-1), pad]))
        mats.append((A, B))
    src16 = torch.cat(slices).contiguous().view(torch.int16)
    return Case(LDMATRIX_MMA, variant, nthreads, src16=src16, n_out_f=nthreads // 32 * 128,
                info=dict(mats=mats))


# ---- cp.async ---------------------------------------------------------------------------------

CP_ASYNC_VARIANTS = {0: "16-byte cp.async.cg", 1: "8- and 4-byte cp.async.ca"}  # mma_probe.cu


def cp_async_case(nthreads: int, seed: int, variant: int = 0) -> Case:
    """Variant 0 copies 16-byte chunks, variant 1 each chunk as 8 + 4 + 4 bytes (same expected)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = 3 * nthreads * 16
    src16 = torch.randint(-2**15, 2**15, (nbytes // 2,), generator=gen, dtype=torch.int32)
    src16 = src16.to(torch.int16)
    words = 3 * nthreads * 4
    return Case(CP_ASYNC, variant, nthreads, src16=src16, n_out_u=4 * words, info=dict(words=words))


def cp_async_expected(case: Case):
    """Per snapshot (4 of them), the expected staging words and a mask of the words that the
    waits have completed by then (the rest are pending: poison in the emulator, unknown on a GPU)."""
    n = case.nthreads
    src_words = case.src16.contiguous().view(torch.int32)  # 4 words per 16-byte chunk
    chunks = torch.arange(3 * n)
    zfilled = (chunks >= n) & (chunks % 5 == CP_ASYNC_ZFILL_SKIP)
    final = src_words.reshape(3 * n, 4).clone()
    final[zfilled] = 0
    group = chunks // n
    exp, done = [], []
    for k, completed in enumerate((1, 2, 3, 3)):  # groups complete after wait<2>, <1>, <0>, all
        e = final.clone()
        if k == 3:  # group 0's slots now hold group 2's source chunks (cp_async_16, no zfill)
            e[:n] = src_words.reshape(3 * n, 4)[2 * n:]
        m = (group < completed).unsqueeze(1).expand(-1, 4)
        exp.append(e.reshape(-1))
        done.append(m.reshape(-1))
    return exp, done


# ---- packing ----------------------------------------------------------------------------------

def pack_values() -> torch.Tensor:
    """Pairs that exercise round-to-nearest-even in bf16 and f16: exact ties both ways, just off
    ties, signs, f16 overflow to inf, f16 subnormals, bf16 near its max."""
    ulp_bf = 2.0**-7  # bf16 spacing at 1
    ulp_h = 2.0**-10  # f16 spacing at 1
    vals = [1.0, -1.0, 1 + ulp_bf / 2, 1 + 3 * ulp_bf / 2, 1 + ulp_bf / 2 + 2**-20,
            -(1 + 3 * ulp_bf / 2), 1 + ulp_h / 2, 1 + 3 * ulp_h / 2, 70000.0, -70000.0,
            65519.0, 65520.0, 3.0e-6, -6.0e-8, 3.0e38, 0.1, -0.0, 0.0, 1e-30, 2.5,
            1234.5678, -0.3333, 7.0e-5, 1.0e4]
    vals += [float(x) for x in torch.linspace(-3, 3, 40)]
    return torch.tensor(vals, dtype=torch.float32)


def pack_case(seed: int = 0) -> Case:
    v = pack_values()
    nthreads = 32 * ((v.numel() // 2 + 31) // 32)
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randn(2 * nthreads - v.numel(), generator=gen) * 100
    in_f = torch.cat([v, extra]).to(torch.float32)
    return Case(PACK, 0, nthreads, in_f=in_f, n_out_u=2 * nthreads, n_out_f=4 * nthreads)


def pack_expected(case: Case):
    x = case.in_f.reshape(-1, 2)
    bf = bits16(x.to(torch.bfloat16))
    h = bits16(x.to(torch.float16))
    out_u = torch.stack([pack_pair(bf[:, 0], bf[:, 1]), pack_pair(h[:, 0], h[:, 1])], dim=1)
    out_f = torch.cat([x.to(torch.bfloat16).float(), x.to(torch.float16).float()], dim=1)
    return out_u.reshape(-1), out_f.reshape(-1)


def misuse_case(op: int, nthreads: int = 32) -> Case:
    src16 = torch.arange(8 * nthreads * 2, dtype=torch.int16)
    return Case(op, 0, nthreads, src16=src16, n_out_u=nthreads * 4)
