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
