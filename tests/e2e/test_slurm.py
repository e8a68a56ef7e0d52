"""launch/slurm.sbatch under a real SLURM on this machine: a private munged, slurmctld and slurmd
(Debian's slurm-wlm) with their own ports, key, socket and state in a temporary folder; the script is
submitted with `sbatch --wait` as a cluster user would, its CPU overrides on the command line and in
the environment, and trains the tiny preset on 1 node x 2 CPU ranks (PP1 x DP2) for 3 steps: the
hostfile from scontrol, srun, `deepspeed --no_ssh --node_rank $SLURM_NODEID`, launch/train.py.

Needs root and slurm-wlm (`apt-get install slurmd slurmctld slurm-client munge`); skips with the reason
otherwise. One node only: Debian's slurmd runs one node per machine (several need a build with
--enable-multiple-slurmd); the two-node path itself is tests/e2e/test_multinode.py.

    python -m pytest tests/e2e/test_slurm.py          (~1 min on 2 cores)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("layout_move_e2e", ROOT / "tests" / "e2e" / "test_layout_move.py")
_move_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_move_e2e)

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "srun")


def find(binary: str) -> str | None:
    return shutil.which(binary) or next((f"{d}/{binary}" for d in ("/usr/sbin", "/usr/bin")
                                         if os.access(f"{d}/{binary}", os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster of this machine; yields the environment its client commands need."""
    if os.geteuid() != 0:
        pytest.skip("a private SLURM needs root (munged, slurmd)")
    missing = [b for b in DAEMONS if find(b) is None]
    if missing:
        pytest.skip(f"slurm-wlm is not installed ({', '.join(missing)} missing): "
                    "apt-get install slurmd slurmctld slurm-client munge")
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    subprocess.run([find("mungekey"), "-c", "-k", str(d / "munge.key")], check=True, capture_output=True)
    (d / "munge.key").chmod(0o600)
    sock = d / "munge.socket"
    subprocess.run([find("munged"), "--force", "--key-file", str(d / "munge.key"), "--socket", str(sock),
                    "--pid-file", str(d / "munged.pid"), "--log-file", str(d / "munged.log"),
                    "--seed-file", str(d / "munged.seed")], check=True, capture_output=True)
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dsttt", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres", "SlurmUser=root", "SlurmdUser=root", "ReturnToService=2",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        subprocess.run([find("slurmctld"), "-c"], env=env, check=True, capture_output=True)
        subprocess.run([find("slurmd")], env=env, check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while subprocess.run([find("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True,
                             text=True).stdout.strip() != "idle":
            assert time.monotonic() < deadline, (d / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield env
    finally:
        for name in ("slurmd", "slurmctld", "munged"):  # only the daemons this fixture started
            pid_file = d / f"{name}.pid"
            if pid_file.is_file():
                try:
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


def test_sbatch_trains_through_srun_and_deepspeed(slurm, tmp_path):
    manifest = _move_e2e.make_data(tmp_path / "data", seed=1)
    # the script derives the accumulation for the node count
    ds = {k: v for k, v in _move_e2e.LAYOUTS["pp1_dp2"][1].items() if k != "gradient_accumulation_steps"}
    (tmp_path / "pp1_dp2.json").write_text(json.dumps(ds))
    (tmp_path / "run.json").write_text(json.dumps({"preset": "tiny", "seed": 0, "save_interval": 1,
                                                   "ttt": {"adaptive_layers": 2, "trainable_scope": "suffix"}}))
    out, job_dir, log = tmp_path / "run", tmp_path / "job", tmp_path / "slurm.out"
    env = {**slurm, "OUTPUT": str(out), "DATA": str(manifest), "MODEL": "", "RUN_CONFIG": str(tmp_path / "run.json"),
           "BASE_DS_CONFIG": str(tmp_path / "pp1_dp2.json"), "GPUS_PER_NODE": "2", "JOB_DIR": str(job_dir),
           "EXTRA_ARGS": "--max_steps 3", "DIST_TIMEOUT": "120", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline", "PY": sys.executable}
    started = time.monotonic()
    overrides = ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}", "--time=10", f"--output={log}"]
    proc = subprocess.run([find("sbatch"), "--wait", *overrides, "launch/slurm.sbatch"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    text = log.read_text() if log.is_file() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + text[-5000:]
    host = socket.gethostname()
    assert (job_dir / "hostfile").read_text() == f"{host} slots=2\n"
    assert json.loads((job_dir / "ds_config.json").read_text())["gradient_accumulation_steps"] == 2
    assert f"[rank 1 @ {host}] joined 2 ranks via master {host}:29500" in text, text[-3000:]
    assert [r["step"] for r in _move_e2e.metrics(out)] == [1, 2, 3]
    assert (out / "latest").read_text().strip() == "step_00000003"
    print(f"\nsbatch -> srun -> deepspeed --no_ssh -> launch/train.py: 3 steps in {time.monotonic() - started:.1f} s")
