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


def _entry_name(fam, dt, d):
    return f"_ZN8flashbob12_GLOBAL__N_1{len(fam)}{fam}I{dt}Li{d}ENS0_5TilesILi64ELi64ELi4EEEEEvPKT_"


def _synthetic_ptx(tmp_path, drop_mma_in=None, drop_entry=None):
    """PTX text with the 24 kernel entries (6 kernels x bf16/fp16 x D 64/128), Itanium-mangled
    like nvcc's; every entry has one mma.sync unless it is `drop_mma_in`."""
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
    assert "tensor-core MMA in all 24 kernel entries" in ok.stdout
    victim = _entry_name("bob_col_kernel", "6__half", 128)
    no_mma = _run_ptx_check(_synthetic_ptx(tmp_path, drop_mma_in=victim))
    assert no_mma.returncode != 0, no_mma.stdout
    assert "bob_col_kernel" in no_mma.stdout and "no mma.sync" in no_mma.stdout
    missing = _run_ptx_check(_synthetic_ptx(tmp_path, drop_entry=victim))
    assert missing.returncode != 0 and "3 PTX entries, expected 4" in missing.stdout
