"""The tensor-core probe on a GPU against the CPU emulator, lane by lane: the proof that the
emulator (csrc/emu/mma_emu.h), and so every emulated FlashBoB kernel test, models the hardware.

    .venv/bin/python -m pytest tests/ops/test_mma_probe_cuda.py -q       # needs a CUDA GPU (sm_80+)

Both builds run the same source, csrc/mma_probe.cu: on the GPU with the inline PTX of
csrc/mma.cuh (built by MmaProbeCUDABuilder, the FlashBoB CUDA builder's flags and arch list), on
the CPU through the emulator. Required: identical registers for ldmatrix (all six forms), the
chained ldmatrix -> mma product, mma with exactly summable inputs, the cp.async data once waited
for (including the zero fill), and the bf16x2/f16x2 packing. For mma with random inputs the
tensor core's internal accumulation may differ from the emulator's (one rounding of an exact
sum) in the last bits (tensor cores align and truncate addends; see Fasi et al., "Numerical
behavior of NVIDIA tensor cores", 2021): there the difference must stay within ACC_ULPS fp32 ulps
of sum |a*b| + |c|, while any layout error would be of the order of the values themselves.
Skips, with the reason, without CUDA.
"""

import pytest
import torch

from ds_ttt.ops.flashbob.probe_builder import MmaProbeCUDABuilder, load_probe_cuda, load_probe_emu
from tests.unit import mma_probe_cases as mc


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch %s)" % torch.__version__
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return "GPU compute capability %d.%d < 8.0 (mma.sync bf16 m16n8k16 needs sm_80+)" % (
            major, minor)
    builder = MmaProbeCUDABuilder()
    if not builder.is_compatible():
        return "probe cannot be built: " + builder.incompatible_reason
    return None


ACC_ULPS = 18  # k + 2 for k = 16 addends: a generous bound on one mma's accumulation error

_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


@pytest.fixture(scope="module")
def probes():
    return mc.Probe(load_probe_cuda(), "cuda"), mc.Probe(load_probe_emu(), "cpu")


def _both(probes, case):
    gpu, emu = probes
    return gpu.run_case(case), emu.run_case(case)


@pytest.mark.parametrize("variant", sorted(mc.LDMATRIX_VARIANTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_ldmatrix_identical(probes, variant, seed):
    case = mc.ldmatrix_case(variant, nthreads=64, seed=seed)
    (g_u, _), (e_u, _) = _both(probes, case)
    assert torch.equal(g_u, e_u), (g_u.reshape(-1, 4)[:4], e_u.reshape(-1, 4)[:4])
    assert torch.equal(g_u, mc.ldmatrix_expected_all(case))  # and the ISA table in Python


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("alias", [False, True], ids=["d_new", "d_is_c"])
def test_mma_exact_sums_identical(probes, dtype, alias):
    case = mc.mma_case(dtype, alias, nthreads=64, seed=3, exact=True)
    (_, g_f), (_, e_f) = _both(probes, case)
    assert torch.equal(g_f, e_f)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_mma_random_close(probes, dtype):
    case = mc.mma_case(dtype, False, nthreads=64, seed=4, exact=False)
    (_, g_f), (_, e_f) = _both(probes, case)
    lanes_g, lanes_e = g_f.reshape(-1, 32, 4), e_f.reshape(-1, 32, 4)
    for w, (A, B, C) in enumerate(case.info["mats"]):
        scale = A.double().abs() @ B.double().abs() + C.double().abs()
        Dg, De = mc.c_matrix(lanes_g[w]).double(), mc.c_matrix(lanes_e[w]).double()
        bound = ACC_ULPS * 2.0**-23 * scale
        assert torch.all((Dg - De).abs() <= bound), (w, ((Dg - De).abs() / scale).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("b_stored_kn", [False, True], ids=["B_nk_ldmatrix", "B_kn_ldmatrix_trans"])
def test_ldmatrix_then_mma_identical_layouts(probes, dtype, b_stored_kn):
    """Random data, so allow the accumulation difference, but any layout error is O(1)."""
    case = mc.ldmatrix_mma_case(dtype, b_stored_kn, nthreads=64, seed=6)
    (_, g_f), (_, e_f) = _both(probes, case)
    for w, (A, B) in enumerate(case.info["mats"]):
        scale = (A.double().abs() @ B.double().abs()).reshape(-1)
        d = (g_f[w * 128:(w + 1) * 128].double() - e_f[w * 128:(w + 1) * 128].double()).abs()
        assert torch.all(d <= ACC_ULPS * 2.0**-23 * scale), (w, d.max())


@pytest.mark.parametrize("variant", sorted(mc.CP_ASYNC_VARIANTS), ids=lambda v: mc.CP_ASYNC_VARIANTS[v])
def test_cp_async_identical_once_waited(probes, variant):
    case = mc.cp_async_case(nthreads=128, seed=8, variant=variant)
    (g_u, _), (e_u, _) = _both(probes, case)
    _, done = mc.cp_async_expected(case)
    g, e = g_u.reshape(4, -1), e_u.reshape(4, -1)
    for k in range(4):
        assert torch.equal(g[k][done[k]], e[k][done[k]]), k


def test_pack_identical(probes):
    case = mc.pack_case()
    (g_u, g_f), (e_u, e_f) = _both(probes, case)
    assert torch.equal(g_u, e_u)
    assert torch.equal(g_f, e_f)
