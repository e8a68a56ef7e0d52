"""launch/slurm.sbatch rendered with fake SLURM variables and DRY_RUN=1 (a fake `scontrol` on PATH):
the hostfile in SLURM's node order, the DeepSpeed config for N nodes (global batch kept), and the srun
command, whose per-node payload is run with SLURM_NODEID set and parsed by DeepSpeed's own launcher
parser and launch/train.py's parser.

    python -m pytest tests/unit/test_slurm_sbatch.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from ds_ttt.train.deepspeed_config import batch_sizes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm.sbatch"


def render(tmp_path: pathlib.Path, hosts: list[str], **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"  # `scontrol show hostnames NODELIST`: one host a line
    scontrol.write_text("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts))
    scontrol.chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu[01-NN]",
            "SLURM_JOB_NUM_NODES": str(len(hosts)), "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT),
            "JOB_DIR": str(tmp_path / "job"), "OUTPUT": "/shared/runs/q8b", "DATA": "/shared/data/manifest.json",
            "PY": sys.executable, **env}
    return subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def node_argv(srun_line: str, node_id: int, tmp_path: pathlib.Path) -> list[str]:
    """What node `node_id` runs: the srun payload under bash, with a fake deepspeed that prints its argv."""
    srun = shlex.split(srun_line)
    assert srun[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert srun[4:6] == ["bash", "-c"]
    payload = srun[6]
    fake = tmp_path / "fake_deepspeed"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    deepspeed = payload.split()[1]
    assert deepspeed == str(ROOT / ".venv" / "bin" / "deepspeed") or deepspeed.endswith("/deepspeed")
    out = subprocess.run(["bash", "-c", payload.replace(deepspeed, str(fake), 1)],
                         env={**os.environ, "SLURM_NODEID": str(node_id)}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_two_nodes_render_the_launcher_per_node(tmp_path):
    proc = render(tmp_path, ["gpu01", "gpu02"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (tmp_path / "job" / "hostfile").read_text() == "gpu01 slots=8\ngpu02 slots=8\n"
    assert "gpu01 slots=8" in lines and "gpu02 slots=8" in lines
    ds = json.loads((tmp_path / "job" / "ds_config.json").read_text())
    shipped = json.loads((ROOT / "ds_configs" / "qwen3_8b_pp4_dp2.json").read_text())
    assert ds["pipeline"]["stages"] == 4 and batch_sizes(ds, dp=4) == (32, 1, 8)  # 16 GPUs = PP4 x DP4
    assert {k: v for k, v in ds.items() if k != "gradient_accumulation_steps"} == \
        {k: v for k, v in shipped.items() if k != "gradient_accumulation_steps"}

    from deepspeed.launcher.runner import parse_args as deepspeed_args
    spec = importlib.util.spec_from_file_location("train_entry", ROOT / "launch" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    for node_id in (0, 1):
        launcher = deepspeed_args(node_argv(lines[-1], node_id, tmp_path))
        assert launcher.no_ssh and launcher.node_rank == node_id
        assert launcher.master_addr == "gpu01" and launcher.master_port == 29500
        assert launcher.hostfile == str(tmp_path / "job" / "hostfile") and launcher.user_script == "launch/train.py"
        args = train.parse_args(launcher.user_args)
        assert args.deepspeed_config == str(tmp_path / "job" / "ds_config.json") and args.dist_timeout == 1800
        assert (args.run_config, args.model, args.data, args.output) == (
            "ds_configs/run_qwen3_8b.json", "/models/Qwen3-8B", "/shared/data/manifest.json", "/shared/runs/q8b")


def test_resume_and_extra_flags(tmp_path):
    proc = render(tmp_path, ["a", "b"], RESUME="1", DIST_TIMEOUT="600", EXTRA_ARGS="--max_steps 1000")
    assert proc.returncode == 0, proc.stderr
    argv = node_argv(proc.stdout.splitlines()[-1], 1, tmp_path)
    tail = argv[argv.index("launch/train.py") + 1:]
    assert tail[-6:] == ["--dist_timeout", "600", "--resume", "/shared/runs/q8b", "--max_steps", "1000"]
    assert "--model" not in tail and "--data" not in tail


@pytest.mark.parametrize("num_nodes", [3, 5])
def test_a_node_count_that_breaks_the_global_batch_is_refused(tmp_path, num_nodes):
    proc = render(tmp_path, [f"gpu{k:02d}" for k in range(num_nodes)])
    assert proc.returncode != 0
    assert f"{num_nodes} nodes x 8 GPUs = data-parallel {num_nodes * 2}, which does not divide the global batch 32" \
        in proc.stderr
