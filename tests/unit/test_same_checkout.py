"""The launch scripts refuse a Python that imports ds_ttt from another checkout (launch/same_checkout.sh).

    python -m pytest tests/unit/test_same_checkout.py

setup.sh installs ds_ttt in editable mode. A second checkout (a worktree of an older commit) whose
.venv links to this one's used to run this checkout's library under the other tree's scripts without
a word: last round's before/after comparison of the main job had to set PYTHONPATH by hand to avoid it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def other_checkout(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tree with this tree's launch scripts and a .venv linked to this tree's environment."""
    tree = tmp_path / "other"
    shutil.copytree(ROOT / "launch", tree / "launch")
    (tree / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "adaptation_baselines.sh", tree / "benchmarks")
    (tree / ".venv").symlink_to(pathlib.Path(sys.prefix))
    return tree


def run(cmd: list[str], cwd: pathlib.Path, **env) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_scripts_refuse_another_checkouts_package(tmp_path):
    import ds_ttt
    if pathlib.Path(ds_ttt.__file__).resolve().parents[1] != ROOT:
        import pytest
        pytest.skip(f"ds_ttt is imported from {ds_ttt.__file__}, not this tree (no editable install)")
    tree = other_checkout(tmp_path)
    for script in ("launch/main.sh", "benchmarks/adaptation_baselines.sh"):
        res = run(["bash", script, str(tmp_path / "work")], tree)
        assert res.returncode == 1, (script, res.returncode, res.stdout[-2000:], res.stderr[-2000:])
        assert (f"imports ds_ttt from {ROOT}, not from this checkout ({tree.resolve()}); run 'bash setup.sh' here"
                in res.stderr), res.stderr
        assert f"PYTHONPATH={tree.resolve()}" in res.stderr
        assert not (tmp_path / "work").exists()  # refused before anything is written


def test_the_check_passes_for_this_tree_and_for_pythonpath(tmp_path):
    check = 'source launch/same_checkout.sh && require_same_checkout .venv/bin/python && echo same'
    res = run(["bash", "-c", check], ROOT) if (ROOT / ".venv").exists() else None
    if res is not None:
        assert res.returncode == 0 and res.stdout == "same\n", res.stderr
    tree = other_checkout(tmp_path)
    shutil.copytree(ROOT / "ds_ttt", tree / "ds_ttt", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    res = run(["bash", "-c", check], tree, PYTHONPATH=str(tree))
    assert res.returncode == 0 and res.stdout == "same\n", res.stderr
