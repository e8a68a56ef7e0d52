"""Load the FlashBoB CUDA op (prebuilt, else JIT through DeepSpeed); write what happened as JSON.

    python gpu_check/build_flashbob.py --out /tmp/build.json

Uses ds_ttt.ops.flashbob.builder.load_cuda_op: the objects of gpu_check/prebuild.sh when
their manifest fits this torch / Python / GPU and the current sources, otherwise a JIT build
(FlashBoBCUDABuilder, with the environment the caller set: CUDA_HOME, TORCH_CUDA_ARCH_LIST,
TORCH_EXTENSIONS_DIR, MAX_JOBS). The JSON records the path taken ("prebuilt" or "jit"), why the
prebuilt objects were not used, the seconds, and for a JIT build the resource usage of its
kernels when cuobjdump is on the machine (for prebuilt objects it is in the committed log
gpu_check/logs/cuobjdump_resource_usage.txt). Exit 0 when the op loaded with its three
entry points (fwd, bwd, bwd_bwd), 1 otherwise (the JSON then says why: the builder's
incompatibility reason or the compiler's error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ENTRY_POINTS = ("fwd", "bwd", "bwd_bwd")


def _prebuilt_fits() -> bool:
    """True when load_cuda_op would import the prebuilt objects (no compiler needed then)."""
    import json

    import torch

    from ds_ttt.ops.flashbob.builder import (FlashBoBCUDABuilder, _prebuilt_dir, prebuilt_mismatch,
                                             sources_digest)

    folder = _prebuilt_dir()
    try:
        manifest = json.loads((folder / "manifest.json").read_text()) if folder else None
    except (OSError, ValueError):
        return False
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return bool(manifest) and cap is not None and not prebuilt_mismatch(manifest, FlashBoBCUDABuilder.NAME, torch_version=torch.__version__,
                                                    python="%d.%d" % sys.version_info[:2],
                                                    digest=sources_digest(), capability=cap)


def _resource_usage(so_file: str | None):
    """cuobjdump's per-kernel registers / stack / local / shared of a JIT build, parsed; None without
    cuobjdump."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prebuild_ops import find_cuobjdump
    from resource_table import parse

    exe = find_cuobjdump()
    if not exe or not so_file:
        return {"skipped": "no cuobjdump on this machine" if not exe else "no module file"}
    r = subprocess.run([exe, "--dump-resource-usage", so_file], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-500:]}
    return [{"arch": a, "kernel": f, "dtype": d, "D": D, **u} for (a, f, d, D), u in sorted(parse(r.stdout).items())]


def build() -> dict:
    t0 = time.perf_counter()
    result = {"ok": False, "env": {k: os.environ.get(k) for k in (
        "CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "MAX_JOBS", "DS_ACCELERATOR")}}
    try:
        from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder, load_cuda_op, load_info

        builder = FlashBoBCUDABuilder()
        result.update(name=builder.NAME, sources=builder.sources(), nvcc_args=builder.nvcc_args())
        result["compatible"] = builder.is_compatible(verbose=True)
        result["incompatible_reason"] = builder.incompatible_reason
        if result["compatible"] or _prebuilt_fits():
            module = load_cuda_op()
            result["load"] = load_info().get(builder.NAME)
            if (result["load"] or {}).get("path") == "jit":
                result["resource_usage"] = _resource_usage(getattr(module, "__file__", None))
            result["module"] = getattr(module, "__file__", None) or module.__name__
            result["entry_points"] = [n for n in ENTRY_POINTS if hasattr(module, n)]
            result["ok"] = result["entry_points"] == list(ENTRY_POINTS)
            if not result["ok"]:
                result["error"] = f"extension lacks entry points: has {result['entry_points']}"
        else:
            result["error"] = f"builder reports incompatible: {builder.incompatible_reason}"
    except Exception as exc:  # noqa: BLE001 - the compiler's error is the result
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args(argv)
    result = build()
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    how = (result.get("load") or {}).get("path", "?")
    status = f"OK ({how})" if result["ok"] else f"FAILED: {result.get('error')}"
    print(f"[build] FlashBoB CUDA op {status} ({result['seconds']} s)", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
