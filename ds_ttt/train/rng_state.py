"""Per-rank RNG states (python, numpy, torch, CUDA) as values that load with `weights_only=True`.

    from ds_ttt.train.rng_state import capture_rng_state, load_rng_state, restore_rng_state, rng_state_file
    torch.save(capture_rng_state(), rng_state_file(ckpt_dir, rank))            # save, every rank
    restore_rng_state(load_rng_state(rng_state_file(ckpt_dir, rank), rank))   # resume, every rank

Each state is stored as tensors, lists and numbers only (numpy's key array as an int64 tensor), so
reading a checkpoint never unpickles an object. A checkpoint holds one file per rank,
`rng/rank_NNNNN.pt`; a resume with another world size finds its file missing and is refused.
"""

from __future__ import annotations

import pathlib
import random
from typing import Any

import numpy as np
import torch

RNG_DIR = "rng"  # inside a checkpoint directory


def rng_state_file(ckpt_dir: pathlib.Path, rank: int) -> pathlib.Path:
    """Where rank `rank`'s RNG state lives inside a checkpoint directory."""
    return ckpt_dir / RNG_DIR / f"rank_{rank:05d}.pt"


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, lists and numbers only (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's RNGs to a `capture_rng_state` result (CUDA only where a GPU is present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_rng_state(path: pathlib.Path, rank: int) -> dict[str, Any]:
    """Read rank `rank`'s state file with weights_only=True; a missing or unsafe file is an error that
    names the rank, the file and the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: rank {rank}'s RNG state is missing from checkpoint {path.parent.parent} "
                                "(the checkpoint is incomplete or was written by a different number of ranks); "
                                "resume with the world size it was saved with, or from another checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: rank {rank}'s RNG state does not load with weights_only=True ({type(e).__name__}); "
                         "it holds pickled objects (such as a numpy state tuple) rather than tensors, lists and "
                         "numbers: resume from a checkpoint this trainer wrote") from e
