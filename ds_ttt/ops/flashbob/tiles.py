"""Tile sets of the FlashBoB CUDA kernels: which tile shapes the launchers use, and picking one.

    from ds_ttt.ops.flashbob.builder import load_cuda_op
    from ds_ttt.ops.flashbob.tiles import tile_sets, use_tile_set
    op = load_cuda_op()
    [s["name"] for s in tile_sets(op)]          # ['sm80', 'sm90', 'sm80_half_bn', 'sm90_half_bn']
    with use_tile_set(op, "sm90_half_bn"):      # every launch in the block, autograd's included
        ...

A tile set gives each of the six kernels its shape (rows owned per block BM, rows streamed per
stage BN, warps) per head dim; csrc/flashbob_cuda_kernel.cu defines them, and all are compiled
into every build. By default the launchers take the set for the device: "sm90" (128-row blocks of
8 warps) on compute capability 9.0 or later with 227 KB of shared memory per block, else "sm80"
(64-row blocks of 4 warps, sized to the A100's 163 KB). The other sets exist for the tile-shape
sweep of gpu_check/bench_flashbob_cuda.py and are built for bf16 at head dim 128 only.

`op` is any build of the kernels: the CUDA extension, the prebuilt C-ABI library (capi.FlashBoBLib)
or the CPU emulator (load_cuda_emu_op(), whose device is set with op.set_emulated_device). The
choice is process-wide: the launchers read it at every launch, whichever thread launches.
"""

from __future__ import annotations

import contextlib
import json

__all__ = ["tile_sets", "tile_set", "active_tile_set", "use_tile_set"]


def tile_sets(op) -> list[dict]:
    """Every set: {"id", "name", "arch" (lowest __CUDA_ARCH__), "dtypes", "shapes": [{"kernel", "D",
    "BM", "BN", "warps", "arch", "smem_bytes"}, ...]}."""
    return [json.loads(op.tile_set_json(i)) for i in range(op.num_tile_sets())]


def tile_set(op, name: str) -> dict:
    """The set called `name` (ValueError naming the known ones otherwise)."""
    sets = tile_sets(op)
    for s in sets:
        if s["name"] == name:
            return s
    raise ValueError(f"unknown tile set {name!r}; the kernels have {[s['name'] for s in sets]}")


def active_tile_set(op) -> dict:
    """The set the next launch uses (the override, or the device's), with "overridden": bool."""
    s = json.loads(op.tile_set_json(op.active_tile_set()))
    return {**s, "overridden": op.tile_set() >= 0}


@contextlib.contextmanager
def use_tile_set(op, name: str | None):
    """Launch with the set `name` inside the block (None: the device's default); the previous
    choice is restored on exit."""
    previous = op.tile_set()
    op.set_tile_set(-1 if name is None else tile_set(op, name)["id"])
    try:
        yield
    finally:
        op.set_tile_set(previous)
