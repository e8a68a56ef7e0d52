"""FlashBoB op builders: absolute paths, unique names, lazy loading, CUDA incompatibility reason.

    .venv/bin/python -m pytest tests/unit/test_flashbob_builder.py -q
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

from ds_ttt.ops.flashbob import builder as fb_builder
from ds_ttt.ops.flashbob.builder import FlashBoBCPUBuilder, FlashBoBCUDABuilder

REPO = Path(__file__).resolve().parents[2]


def test_builders_use_absolute_existing_paths_and_unique_names():
    for b in (FlashBoBCPUBuilder(), FlashBoBCUDABuilder()):
        for p in b.sources() + b.include_paths():
            assert os.path.isabs(p) and os.path.exists(p), p
        assert b.NAME.startswith("ds_ttt_flashbob_") and b.absolute_name().endswith(b.NAME + "_op")
    assert FlashBoBCPUBuilder.NAME != FlashBoBCUDABuilder.NAME
    assert any(p.endswith(".cu") for p in FlashBoBCUDABuilder().sources())


def test_cpu_builder_flags():
    args = FlashBoBCPUBuilder().cxx_args()
    assert "-O3" in args and "-fopenmp" in args
    assert "-ffast-math" not in args  # the kernels rely on IEEE infinities
    assert not any(a.startswith("-std=c++1") for a in args)  # torch headers need C++20


def test_cuda_builder_flags_and_reason_on_cpu_torch(monkeypatch):
    b = FlashBoBCUDABuilder()
    assert "--use_fast_math" not in b.nvcc_args() and "-std=c++20" in b.nvcc_args()
    if torch.version.cuda is None:
        assert b.is_compatible() is False
        assert "CPU-only" in b.incompatible_reason


def test_default_extensions_dir_is_project_local_and_per_torch_build():
    d = fb_builder.default_extensions_dir()
    assert d.parent == REPO / ".torch_extensions"
    assert torch.__version__.replace("+", "-") in d.name


def test_import_does_not_build_or_load():
    code = ("import ds_ttt.ops.flashbob as f, ds_ttt.ops.flashbob.function, sys;"
            "from ds_ttt.ops.flashbob import builder;"
            "assert builder._OPS == {}, builder._OPS;"
            "assert not any(m.endswith('_flashbob_cpu') or 'flashbob_cpu_op' in m "
            "for m in sys.modules), 'extension imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]


def test_load_cpu_op_is_cached_and_exports_entry_points():
    op = fb_builder.load_cpu_op()
    assert fb_builder.load_cpu_op() is op
    assert all(hasattr(op, n) for n in ("fwd", "bwd", "bwd_bwd"))


def test_cuda_builder_targets_sm80_and_sm90_and_the_check_uses_that_list():
    assert FlashBoBCUDABuilder.ARCH_LIST.split(";") == ["8.0", "9.0"]
    script = (REPO / ".ci" / "cuda_build_check.sh").read_text()
    assert "FlashBoBCUDABuilder as B; print(B.ARCH_LIST)" in script


_PTX_FAMILIES = ("fwd_kernel", "bwd_row_kernel", "bwd_col_kernel", "bob_stats_kernel",
                 "bob_row_kernel", "bob_col_kernel")


def _entry_name(fam, dt, d, arch=800):
    return f"_ZN8flashbob12_GLOBAL__N_1{len(fam)}{fam}I{dt}Li{d}ENS0_5TilesILi64ELi64ELi4ELi{arch}EEEEEvPKT_"


def _synthetic_ptx(tmp_path, drop_mma_in=None, drop_entry=None, stub_with_mma=False):
    """sm_80 PTX text with the 24 kernel entries (6 kernels x bf16/fp16 x D 64/128), Itanium-mangled
    like nvcc's, each with one mma.sync unless it is `drop_mma_in`; plus, per kernel, a stub of a
    tile shape built for sm_90 (a trap; with an mma too if `stub_with_mma`)."""
    lines = [".version 8.8", ".target sm_80", ".address_size 64"]
    for fam in _PTX_FAMILIES:
        for dt in ("13__nv_bfloat16", "6__half"):
            for d in (64, 128):
                name = _entry_name(fam, dt, d)
                if name == drop_entry:
                    continue
                lines += [f".entry {name}(", "\t.param .u64 p0", ")", "{",
                          "\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];"]
                if name != drop_mma_in:
                    lines.append("\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                 "{%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, "
                                 "{%f1, %f2, %f3, %f4};")
                lines += ["\tret;", "}"]
        lines += [f".entry {_entry_name(fam, '13__nv_bfloat16', 128, arch=900)}(", "\t.param .u64 p0", ")", "{",
                  "\ttrap;"]
        if stub_with_mma:
            lines.append("\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, "
                         "{%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};")
        lines += ["\tret;", "}"]
    p = tmp_path / "kernels.ptx"
    p.write_text("\n".join(lines) + "\n")
    return p


def _run_ptx_check(path):
    return subprocess.run(["bash", str(REPO / ".ci" / "cuda_build_check.sh")], cwd=REPO,
                          capture_output=True, text=True,
                          env={**os.environ, "FLASHBOB_PTX_CHECK_ONLY": str(path)})


def test_ptx_check_passes_only_when_every_kernel_entry_has_mma(tmp_path):
    ok = _run_ptx_check(_synthetic_ptx(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "tensor-core MMA in all 24 compiled kernel entries (6 stubs of tile shapes" in ok.stdout
    victim = _entry_name("bob_col_kernel", "6__half", 128)
    no_mma = _run_ptx_check(_synthetic_ptx(tmp_path, drop_mma_in=victim))
    assert no_mma.returncode != 0, no_mma.stdout
    assert "bob_col_kernel" in no_mma.stdout and "no mma.sync" in no_mma.stdout
    missing = _run_ptx_check(_synthetic_ptx(tmp_path, drop_entry=victim))
    assert missing.returncode != 0 and "bob_col_kernel: no compiled PTX entry for fp16 D=128" in missing.stdout
    bad_stub = _run_ptx_check(_synthetic_ptx(tmp_path, stub_with_mma=True))
    assert bad_stub.returncode != 0 and "must be a trap stub here" in bad_stub.stdout


# ---- prebuilt objects: the C-ABI library (capi.py) and the manifest rules of load_with_prebuilt ---------

import json  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

from ds_ttt.ops.flashbob.capi import FlashBoBLib, ProbeLib  # noqa: E402


@pytest.fixture(scope="module")
def emu_capi_lib(tmp_path_factory):
    """csrc/flashbob_capi.cpp over the CPU emulator (csrc/emu/capi_emu.cpp), built with g++ (~5 s)."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    assert cxx, "no C++ compiler on PATH (set CXX): the C-ABI tests need one"
    out = tmp_path_factory.mktemp("capi") / "libflashbob_emu.so"
    csrc = fb_builder.CSRC
    include = Path(torch.__file__).parent / "include"  # c10 BFloat16/Half (header-only) for the emulator
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-Wno-reorder", f"-I{csrc}", f"-I{csrc / 'emu'}",
                        "-isystem", str(include), str(csrc / "emu" / "capi_emu.cpp"), "-o", str(out), "-pthread"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _qkv(D=64, dtype=torch.bfloat16, N=40):
    g = torch.Generator().manual_seed(0)
    q, do, uq = (torch.randn(1, 4, N, D, generator=g).to(dtype) for _ in range(3))
    k, v, uk, uv = (torch.randn(1, 2, N, D, generator=g).to(dtype) for _ in range(4))
    return q, k, v, do, uq, uk, uv


@pytest.mark.parametrize("D, dtype", [(64, torch.bfloat16), (128, torch.float16)])
def test_capi_path_gives_the_torch_binding_bits(emu_capi_lib, D, dtype):
    """The ctypes path (argument order, Geo packing, dtype codes) against the torch-extension build of
    the same emulated kernels: every output must be bit-identical."""
    capi, ext = FlashBoBLib(emu_capi_lib, device_type="cpu"), fb_builder.load_cuda_emu_op()
    q, k, v, do, uq, uk, uv = _qkv(D, dtype)
    args = (True, 30, 0, 0, D ** -0.5)
    o1, s1 = capi.fwd(q, k, v, *args)
    o2, s2 = ext.fwd(q, k, v, *args)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    assert capi.last_launched_kernel() == "fwd_kernel"
    for a, b in zip(capi.bwd(q, k, v, o1, s1, do, *args), ext.bwd(q, k, v, o2, s2, do, *args)):
        assert torch.equal(a, b)
    dq = torch.zeros_like(q)
    for a, b in zip(capi.bwd_bwd(q, k, v, o1, s1, do, dq, uq, None, uv, *args),
                    ext.bwd_bwd(q, k, v, o2, s2, do, dq, uq, None, uv, *args)):
        assert torch.equal(a, b)
    assert capi.last_launched_kernel() == "bob_col_kernel"


def test_capi_checks_and_errors_read_like_the_binding(emu_capi_lib):
    capi = FlashBoBLib(emu_capi_lib, device_type="cpu")
    q, k, v, *_ = _qkv()
    flat = torch.randn(q.numel() + 1).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="q must start at a 16-byte aligned address"):
        capi.fwd(flat[1:].view(q.shape), k, v, True, 0, 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="supports head dim 64/128, got 32"):
        capi.fwd(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), True, 0, 0, 0, 0.1)
    with pytest.raises(RuntimeError, match="window must be >= 0 and needs causal"):
        capi.fwd(q, k, v, False, 5, 0, 0, 0.125)
    with pytest.raises(RuntimeError, match="must be a CPU tensor"):  # the GPU build says "CUDA tensor"
        FlashBoBLib(emu_capi_lib, device_type="cpu").fwd(q.to("meta"), k, v, True, 0, 0, 0, 0.125)
    capi.fwd(q, k, v, True, 0, 0, 0, 0.125)  # fwd_kernel is now the last one enqueued
    with pytest.raises(RuntimeError, match=r"flashbob cuda fwd failed in fwd_kernel: .*CUDA_LAUNCH_BLOCKING=1"):
        capi._launch("fwd", lambda: 1)


def test_capi_tile_sets_read_and_switch_like_the_binding(emu_capi_lib):
    """The tile-set functions through ctypes: the same sets as the torch-extension build, the
    override and its refusals; the device rule itself is tested in test_flashbob_cuda_emu.py."""
    from ds_ttt.ops.flashbob.tiles import active_tile_set, tile_sets, use_tile_set

    capi, ext = FlashBoBLib(emu_capi_lib, device_type="cpu"), fb_builder.load_cuda_emu_op()
    assert tile_sets(capi) == tile_sets(ext) and len(tile_sets(capi)) == capi.num_tile_sets() == 4
    assert active_tile_set(capi)["name"] == "sm80" and capi.device_tile_set() == 0  # its emulated A100
    q, k, v, *_ = _qkv()
    with use_tile_set(capi, "sm90"):
        assert capi.tile_set() == 1 and active_tile_set(capi)["overridden"]
        with pytest.raises(RuntimeError, match="sm90 is compiled for sm_90 and later; this GPU is sm_80"):
            capi.fwd(q, k, v, True, 0, 0, 0, 0.125)
    with use_tile_set(capi, "sm80_half_bn"), pytest.raises(RuntimeError, match="bfloat16 at head dim 128 only"):
        capi.bwd(q, k, v, q, torch.zeros(1, 4, 40, 2), q, True, 0, 0, 0, 0.125)
    assert capi.tile_set() == -1
    with pytest.raises(RuntimeError, match="no tile set 9"):
        capi.set_tile_set(9)


def test_capi_probe_gives_the_probe_binding_registers(emu_capi_lib):
    from ds_ttt.ops.flashbob.probe_builder import load_probe_emu
    from tests.unit import mma_probe_cases as mc

    capi, ext = mc.Probe(ProbeLib(emu_capi_lib, device_type="cpu"), "cpu"), mc.Probe(load_probe_emu(), "cpu")
    for case in (mc.ldmatrix_case(5, nthreads=64, seed=1), mc.mma_case(torch.float16, True, 64, 3, True),
                 mc.cp_async_case(nthreads=128, seed=8)):
        (u1, f1), (u2, f2) = capi.run_case(case), ext.run_case(case)
        assert torch.equal(u1, u2) and torch.equal(f1, f2)


def _manifest(folder, file, *, abi="c", gpu=False, digest=None, **extra):
    (folder / "manifest.json").write_text(json.dumps({
        "torch": torch.__version__, "python": "%d.%d" % sys.version_info[:2], "arch_list": "8.0;9.0",
        "sources_sha256": digest or fb_builder.sources_digest(),
        "modules": {"x": {"file": file, "abi": abi, "gpu": gpu}}, **extra}))


def test_load_with_prebuilt_uses_a_fitting_library_and_records_why_not_otherwise(emu_capi_lib, tmp_path,
                                                                                   monkeypatch):
    shutil.copy(emu_capi_lib, tmp_path / "lib.so")
    monkeypatch.setenv("DS_TTT_FLASHBOB_PREBUILT", str(tmp_path))
    wrap = lambda p: FlashBoBLib(p, device_type="cpu")  # noqa: E731
    _manifest(tmp_path, "lib.so")
    lib = fb_builder.load_with_prebuilt("x", lambda: pytest.fail("JIT despite a fitting prebuilt library"),
                                        gpu=False, capi=wrap)
    assert isinstance(lib, FlashBoBLib) and fb_builder.load_info()["x"]["path"] == "prebuilt"
    _manifest(tmp_path, "lib.so", digest="0" * 64)  # sources edited after the prebuild
    assert fb_builder.load_with_prebuilt("x", lambda: "jit-module", gpu=False, capi=wrap) == "jit-module"
    info = fb_builder.load_info()["x"]
    assert info["path"] == "jit" and "sources changed" in info["prebuilt_skipped"]
    monkeypatch.setenv("DS_TTT_FLASHBOB_PREBUILT", "0")
    fb_builder.load_with_prebuilt("x", lambda: "jit-module", gpu=False, capi=wrap)
    assert "disabled" in fb_builder.load_info()["x"]["prebuilt_skipped"]


def test_prebuilt_manifest_rules():
    m = {"torch": "2.14.1+cu130", "python": "3.11", "arch_list": "8.0;9.0", "sources_sha256": "abc",
         "modules": {"c": {"file": "l.so", "abi": "c", "gpu": True},
                     "t": {"file": "t.so", "abi": "torch", "gpu": False}}}
    kw = dict(torch_version="2.11.0+cu130", python="3.12", digest="abc")
    assert fb_builder.prebuilt_mismatch(m, "c", capability=(9, 0), **kw) == ""  # any torch, any Python
    assert fb_builder.prebuilt_mismatch(m, "c", capability=(8, 6), **kw) == ""  # sm_80 cubin runs on 8.6
    assert "this GPU is sm_100" in fb_builder.prebuilt_mismatch(m, "c", capability=(10, 0), **kw)
    assert "this GPU is sm_75" in fb_builder.prebuilt_mismatch(m, "c", capability=(7, 5), **kw)
    assert "torch 2.11.0+cu130" in fb_builder.prebuilt_mismatch(m, "t", capability=None, **kw)
    assert "Python 3.12" in fb_builder.prebuilt_mismatch(m, "t", capability=None,
                                                          **{**kw, "torch_version": "2.14.1+cu130"})
    assert "sources changed" in fb_builder.prebuilt_mismatch(m, "c", capability=(9, 0), **{**kw, "digest": "x"})
    assert "no module nope" in fb_builder.prebuilt_mismatch(m, "nope", capability=None, **kw)
