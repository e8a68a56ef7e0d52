"""GPU tests of the FlashBoB CUDA backend (skipped, with the reason, where CUDA is unavailable).

    .venv/bin/python -m pytest tests/ops/test_flashbob_cuda.py -q        # on a machine with a GPU

Same cases as the CPU suite (tests/unit/flashbob_cases.py) at head dims 64 and 128, bf16 and
fp16. Tolerances are derived, FA-style: the kernel's error against the float64 reference must be
<= k x the error of the reference itself run in the same low precision (k from FACTORS: 2 for
the output, 3 for first-order grads, 4 for second-order outputs), plus a few ulps of the
output's magnitude.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available (torch %s): the cuda backend can only be compile-checked "
                "here, see .ci/cuda_build_check.sh" % torch.__version__, allow_module_level=True)

from ds_ttt.ops.flashbob import attention  # noqa: E402
from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder  # noqa: E402
from tests.unit.flashbob_cases import (CASES, FACTORS, NAMES, TANGENT_PATTERNS,  # noqa: E402
                                       derived_tol, make_inputs, max_err, second_order)

_builder = FlashBoBCUDABuilder()
if not _builder.is_compatible():
    pytest.skip(f"flashbob cuda builder incompatible: {_builder.incompatible_reason}",
                allow_module_level=True)

DTYPES = [torch.bfloat16, torch.float16]


def _with_head_dim(case, D):
    name, B, Hq, Hkv, Nq, Nk, _, kw = case
    return (f"{name}-d{D}", B, Hq, Hkv, Nq, Nk, D, kw)


GPU_CASES = [_with_head_dim(c, D) for c in CASES for D in (64, 128)]


def _check(case, dtype, pattern=(1, 1, 1), seed=0):
    _, B, Hq, Hkv, Nq, Nk, D, kw = case
    inputs = make_inputs(B, Hq, Hkv, Nq, Nk, D, seed=seed)
    ref64 = second_order(inputs, backend="reference", dtype=torch.float64, pattern=pattern, **kw)
    ref_lp = second_order(inputs, backend="reference", dtype=dtype, device="cuda",
                          pattern=pattern, **kw)
    out = second_order(inputs, backend="cuda", dtype=dtype, device="cuda", pattern=pattern, **kw)
    for n in NAMES:
        assert torch.isfinite(out[n]).all(), n
        err, err_ref = max_err(out[n], ref64[n]), max_err(ref_lp[n], ref64[n])
        tol = derived_tol(err_ref, ref64[n], dtype, FACTORS[n])
        assert err <= tol, (n, err, err_ref, tol)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_matches_reference(case, dtype):
    _check(case, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", TANGENT_PATTERNS, ids=lambda p: "uq%d_uk%d_uv%d" % p)
def test_cuda_zero_tangent_patterns(pattern):
    case = ("gqa_window", 1, 4, 2, 70, 90, 64, dict(causal=True, window=40))
    out = _check(case, torch.bfloat16, pattern=pattern, seed=2)
    if pattern == (0, 0, 1):
        assert torch.count_nonzero(out["vbar"]) == 0


@pytest.mark.gpu
def test_cuda_fully_masked_rows_are_exact_zeros():
    inputs = make_inputs(1, 2, 1, 50, 60, 64, seed=3)
    out = second_order(inputs, backend="cuda", dtype=torch.bfloat16, device="cuda", causal=True,
                       q_offset=0, k_offset=20)
    for n in ("o", "dq", "qbar", "dobar"):
        assert torch.isfinite(out[n]).all(), n
        assert torch.count_nonzero(out[n][:, :, :20]) == 0, n


@pytest.mark.gpu
def test_cuda_auto_backend_and_third_derivative_raises():
    q, k, v = (torch.randn(1, 2, 70, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    o = attention(q, k, v)
    assert type(o.grad_fn).__name__ == "AttnFuncBackward"
    (dq,) = torch.autograd.grad(o.float().square().sum(), q, create_graph=True)
    (qbar,) = torch.autograd.grad(dq.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="third derivative"):
        torch.autograd.grad(qbar.float().sum(), q)


@pytest.mark.gpu
def test_cuda_long_sequence_matches_reference_on_a_slice():
    # N = 2048 exercises many tiles and the causal tile skipping; compare against the fp32
    # reference (float64 would be slow) with the same derived rule.
    g = torch.Generator(device="cuda").manual_seed(5)
    shape_q, shape_kv = (1, 4, 2048, 128), (1, 2, 2048, 128)
    q32, k32, v32 = (torch.randn(s, device="cuda", generator=g)
                     for s in (shape_q, shape_kv, shape_kv))
    outs = {}
    for name, dt, be in (("ref32", torch.float32, "reference"),
                         ("ref_bf16", torch.bfloat16, "reference"),
                         ("cuda", torch.bfloat16, "cuda")):
        q, k, v = (t.to(dt).requires_grad_(True) for t in (q32, k32, v32))
        o = attention(q, k, v, backend=be, window=1000)
        dq, dk, dv = torch.autograd.grad(o.float().sum(), (q, k, v), create_graph=True)
        second = torch.autograd.grad(dq.float().square().sum() + dv.float().sum(), (q, k, v))
        outs[name] = [t.detach().float() for t in (o, dq, dk, dv, *second)]
    for i, (a, b, r) in enumerate(zip(outs["cuda"], outs["ref_bf16"], outs["ref32"])):
        err, err_ref = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 4 * err_ref + 4 * torch.finfo(torch.bfloat16).eps * r.abs().max().item(), i


@pytest.mark.gpu
def test_cuda_rejects_a_misaligned_contiguous_view_with_a_clear_error():
    # The tensor-core kernels stream rows with 16-byte cp.async; a contiguous view that starts
    # one element into its storage must be refused by name, not fault on the GPU.
    flat = torch.randn(1 * 2 * 64 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    q = flat[1:].view(1, 2, 64, 64)
    k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert q.is_contiguous()
    with pytest.raises(RuntimeError, match="q must start at a 16-byte aligned address"):
        attention(q, k, v, backend="cuda")
    o = attention(q.clone(), k, v, backend="cuda")  # the fix the message names works
    assert torch.isfinite(o).all()


@pytest.mark.gpu
def test_cuda_large_gqa_step_matches_reference_at_head_dim_128():
    # H = 8/2, N = 1024, D = 128: many tiles of every kernel, GQA head packing across blocks,
    # causal tile skipping, in bf16 against the fp32 reference with the derived rule.
    g = torch.Generator(device="cuda").manual_seed(11)
    shapes = ((1, 8, 1024, 128), (1, 2, 1024, 128), (1, 2, 1024, 128), (1, 8, 1024, 128))
    base = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    outs = {}
    for name, dt, be in (("ref32", torch.float32, "reference"),
                         ("ref_bf16", torch.bfloat16, "reference"),
                         ("cuda", torch.bfloat16, "cuda")):
        q, k, v, do = (t.to(dt).requires_grad_(True) for t in base)
        o = attention(q, k, v, backend=be)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        phi = (dq.float().square().sum() + (dk.float() * dv.float()).sum())
        second = torch.autograd.grad(phi, (q, k, v, do))
        outs[name] = [t.detach().float() for t in (o, dq, dk, dv, *second)]
    for i, (a, b, r) in enumerate(zip(outs["cuda"], outs["ref_bf16"], outs["ref32"])):
        err, err_ref = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 4 * err_ref + 4 * torch.finfo(torch.bfloat16).eps * r.abs().max().item(), i


@pytest.mark.gpu
@pytest.mark.parametrize("set_name", ["sm80", "sm90", "sm80_half_bn", "sm90_half_bn"])
def test_cuda_every_tile_set_matches_reference(set_name):
    # Every tile set the library carries (ds_ttt/ops/flashbob/tiles.py), not only the device's
    # default: the tile-shape sweep times them all. bf16 at D = 128 (what every set is built for),
    # GQA, causal with a window, several 128-row and 128-key blocks.
    from ds_ttt.ops.flashbob.builder import load_cuda_op
    from ds_ttt.ops.flashbob.tiles import tile_set, use_tile_set

    op = load_cuda_op()
    major, minor = torch.cuda.get_device_capability()
    if tile_set(op, set_name)["arch"] > major * 100 + minor * 10:
        pytest.skip(f"tile set {set_name} is compiled for sm_{tile_set(op, set_name)['arch'] // 10}+")
    case = ("gqa_window_blocks", 1, 4, 2, 200, 300, 128, dict(causal=True, window=150))
    with use_tile_set(op, set_name):
        _check(case, torch.bfloat16, seed=4)
