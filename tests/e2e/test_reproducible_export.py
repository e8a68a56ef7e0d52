"""One seed, one export: the main job's own steps, twice, give byte-identical safetensors.

The main job's data, training and export commands (launch/main.sh, steps 1-3 and 6) run twice in two
work directories, each from scratch: generate trajectories in real sandboxes (seed 0, plus memory
episodes at seed 1), prepare the manifest with the compact vocabulary, meta-train the main recipe
(ds_configs/run_cpu_tiny.json on ds_configs/cpu_tiny_pp1_dp2.json: one stage, two data-parallel CPU
ranks, through DeepSpeed's launcher) for a few steps, export. Every safetensors file of the two exports
is equal byte for byte, and so are the two manifests (but for the directory each names) and the two
runs' losses. A nondeterministic op,
an unseeded draw or a file order that depends on the filesystem fails it.

    python -m pytest tests/e2e/test_reproducible_export.py     (two 2-rank trainings, ~1.5 min on 2 cores)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
pytestmark = pytest.mark.slow
MAX_STEPS = 3


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, " ".join(cmd) + f"\nrc {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


def main_job_through_export(work: pathlib.Path) -> pathlib.Path:
    py = sys.executable
    run([py, "data_prep/generate.py", "--out", str(work / "raw"), "--num", "12", "--seed", "0"])
    run([py, "data_prep/generate.py", "--out", str(work / "raw_extra"), "--num", "6", "--seed", "1",
         "--family", "memory", "--no-token-stats"])
    run([py, "data_prep/prepare.py", "--inputs", str(work / "raw" / "trajectories.jsonl"),
         "--train-only", str(work / "raw_extra" / "trajectories.jsonl"), "--out", str(work / "data"),
         "--seed", "0", "--trim-vocab"])
    run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
         "--deepspeed_config", "ds_configs/cpu_tiny_pp1_dp2.json", "--run_config", "ds_configs/run_cpu_tiny.json",
         "--data", str(work / "data" / "manifest.json"), "--output", str(work / "run"), "--max_steps", str(MAX_STEPS)])
    run([py, "launch/export.py", "--checkpoint", str(work / "run"), "--out", str(work / "export")])
    return work


def losses(work: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_two_runs_from_one_seed_export_identical_safetensors(tmp_path):
    a, b = main_job_through_export(tmp_path / "a"), main_job_through_export(tmp_path / "b")
    manifests = [(w / "data" / "manifest.json").read_bytes().replace(str(w).encode(), b"WORK") for w in (a, b)]
    assert manifests[0] == manifests[1]  # the manifest names its own directory; nothing else may differ
    assert len(losses(a)) == MAX_STEPS and losses(a) == losses(b)
    files_a = sorted(p.relative_to(a / "export") for p in (a / "export").rglob("*.safetensors"))
    files_b = sorted(p.relative_to(b / "export") for p in (b / "export").rglob("*.safetensors"))
    assert files_a == files_b and any(f.name == "prime.safetensors" for f in files_a), files_a
    differ = [str(f) for f in files_a if (a / "export" / f).read_bytes() != (b / "export" / f).read_bytes()]
    assert not differ, f"one seed exported other bytes in {differ}"
