"""Durable, atomic file writes: a reader sees the old content or the new, never a mix, even after a crash.

    from ds_ttt.train.atomic_io import fsync_path, fsync_tree, write_json_atomic, write_text_atomic
    write_json_atomic(run_dir / "run_config.json", resolved)

A rename is durable only once its directory is flushed, so every write here ends with an fsync of the
parent directory. The checkpoint protocol (ds_ttt/train/checkpoint.py) builds on these.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any


def fsync_path(path: pathlib.Path) -> None:
    """Flush a file's or a directory's entry to disk (a rename is durable only after its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: pathlib.Path) -> None:
    """Flush every file and directory under `root` (root included)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(pathlib.Path(dirpath) / name)
        fsync_path(pathlib.Path(dirpath))


def write_text_atomic(path: pathlib.Path, text: str) -> None:
    """temp file + fsync + os.replace + fsync of the directory: readers see the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json_atomic(path: pathlib.Path, data: Any) -> None:
    """`data` as indented JSON with sorted keys (values JSON cannot hold are written as str)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str))
