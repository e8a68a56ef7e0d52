"""Build (JIT, through DeepSpeed) and import the FlashBoB CUDA op; write what happened as JSON.

    python benchmarks/gpu/build_flashbob.py --out /tmp/build.json

Uses ds_ttt.ops.flashbob.builder (FlashBoBCUDABuilder.is_compatible, then load_cuda_op) with the
environment the caller set: CUDA_HOME, TORCH_CUDA_ARCH_LIST, TORCH_EXTENSIONS_DIR, MAX_JOBS.
Exit 0 when the op loaded with its three entry points (fwd, bwd, bwd_bwd), 1 otherwise
(the JSON then says why: the builder's incompatibility reason or the compiler's error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ENTRY_POINTS = ("fwd", "bwd", "bwd_bwd")


def build() -> dict:
    t0 = time.perf_counter()
    result = {"ok": False, "env": {k: os.environ.get(k) for k in (
        "CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "MAX_JOBS", "DS_ACCELERATOR")}}
    try:
        from ds_ttt.ops.flashbob.builder import FlashBoBCUDABuilder, load_cuda_op

        builder = FlashBoBCUDABuilder()
        result.update(name=builder.NAME, sources=builder.sources(), nvcc_args=builder.nvcc_args())
        result["compatible"] = builder.is_compatible(verbose=True)
        result["incompatible_reason"] = builder.incompatible_reason
        if result["compatible"]:
            module = load_cuda_op()
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
    status = "OK" if result["ok"] else f"FAILED: {result.get('error')}"
    print(f"[build] FlashBoB CUDA op {status} ({result['seconds']} s)", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
