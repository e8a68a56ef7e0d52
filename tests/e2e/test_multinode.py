"""launch/train.py on two real nodes: two network namespaces on this machine (tests/e2e/netns.py), each
with its own IPv4 address, hostname and loopback, joined by a veth pair. Every run starts through
DeepSpeed's own launcher, once per node, as on a cluster without ssh:

    ip netns exec NODE  deepspeed --hostfile HOSTFILE --no_ssh --node_rank K --master_addr NODE0_ADDR \
        --master_port 29500 launch/train.py --deepspeed_config PP1xDP2.json ... --dist_timeout 20

with GLOO_SOCKET_IFNAME=ttt0 (the veth end on each node). The shipped CPU recipe (run_cpu_tiny.json,
tiny-mem, a checkpoint every step) on 2 nodes x 1 CPU rank (cpu_tiny_pp1_dp2.json, 4 steps) for A, R, K
and on 2 nodes x 2 CPU ranks (the same with accumulation 1: PP1 x DP4, 3 steps) for M:

  A  the two-node run: every rank joins over the node addresses (master node0's ttt0 address, interface
     ttt0 with the node's own address, never loopback); metrics for steps 1-4;
  R  a node-local --output (each node's own folder bind-mounted at the same path): refused at startup
     on every node, naming node1, whose marker node0 cannot see; nothing trained. node1 starts first
     and prints who it waits for ("waiting for master ADDR:PORT (rank 0) ... 10 s") until node0 comes;
  K  a node lost mid-run: in step 3 (once `latest` names step 2) node1's cable is cut and every
     process of node1 SIGKILLed (no FIN, no RST reaches node0, as when a machine dies); node0's ranks
     stop by themselves within STOP_BOUND_S (--dist_timeout + 30 s) with the lost-peer error; `latest`
     names a complete checkpoint; resuming K on both nodes gives A's losses, step for step, bit for bit;
  M  moving off a node: B, an uninterrupted run on 2 nodes x 2 ranks (ranks 0-1 on node0, 2-3 on node1),
     PP1 x DP4 (micro-batch 1 x accumulation 1 x dp 4), has its step-1 checkpoint continued on node0
     alone, 1 node x 2 ranks, PP2 x DP1 (micro 2 x accumulation 2; the layout move: --resume B/step_1
     --output M) for steps 2-3; losses within tests/e2e/test_layout_move.py's LOSS_RTOL of B's (the same
     global batch of N = 4 terms), learning rates and token counts equal.

Needs root (network and mount namespaces); skips with the reason elsewhere.

    python -m pytest tests/e2e/test_multinode.py -s     (eight launches, 140 CPU-seconds, 4 min on 2 cores)
    python -m pytest tests/e2e/test_multinode.py -k move -s   (M alone: two launches, 47 s)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from netns import IFNAME, Cluster  # noqa: E402

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("layout_move_e2e", ROOT / "tests" / "e2e" / "test_layout_move.py")
_move_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_move_e2e)
make_data, metrics, LOSS_RTOL = _move_e2e.make_data, _move_e2e.metrics, _move_e2e.LOSS_RTOL

MASTER_PORT = 29500  # each namespace has its own ports: no clash with anything else on this machine
DIST_TIMEOUT_S = 20  # --dist_timeout of every launch here
WAITING_TIMEOUT_S = 120  # the refusal's launches: node1 starts alone and waits for node0 to come up
STOP_BOUND_S = DIST_TIMEOUT_S + 30  # node loss -> node0's launcher gone: the timeout, then the error and exit
RUN = {**json.loads((ROOT / "ds_configs" / "run_cpu_tiny.json").read_text()), "save_interval": 1}
PP1_DP2 = json.loads((ROOT / "ds_configs" / "cpu_tiny_pp1_dp2.json").read_text())  # global batch 4 = 1 x 2 x 2
PP1_DP4 = {**PP1_DP2, "gradient_accumulation_steps": 1}  # the same global batch: 1 x 1 x 4
PP2_DP1 = {**PP1_DP2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "pipeline": {**PP1_DP2["pipeline"], "stages": 2}}  # the same global batch: 2 x 2 x 1
STEPS = 4
MOVE_STEPS = 3  # B: the move continues its step-1 checkpoint for steps 2-3 (step 3 shows the moved AdamW moments)


@pytest.fixture(scope="module")
def cluster():
    reason = Cluster.unavailable()
    if reason is not None:
        pytest.skip(f"two nodes need network namespaces: {reason}")
    with Cluster.create(2) as made:
        yield made


@pytest.fixture(scope="module")
def work(tmp_path_factory, cluster):
    tmp = tmp_path_factory.mktemp("multinode")
    (tmp / "pp1_dp2.json").write_text(json.dumps(PP1_DP2))
    (tmp / "pp1_dp4.json").write_text(json.dumps(PP1_DP4))
    (tmp / "pp2_dp1.json").write_text(json.dumps(PP2_DP1))
    (tmp / "run.json").write_text(json.dumps(RUN))
    (tmp / "hostfile_2x1").write_text(cluster.hostfile(slots=1))
    (tmp / "hostfile_2x2").write_text(cluster.hostfile(slots=2))
    (tmp / "hostfile_1x2").write_text("node0 slots=2\n")
    return {"tmp": tmp, "manifest": make_data(tmp / "data", seed=1), "runs": {}}


class Launch:
    """launch/train.py started by DeepSpeed's launcher on each of `nodes` (one Popen per node)."""

    def __init__(self, cluster: Cluster, work: dict, args: list[str], *, hostfile: str = "hostfile_2x1",
                 ds: str = "pp1_dp2.json", nodes: tuple[int, ...] = (0, 1), binds: dict | None = None,
                 dist_timeout: int = DIST_TIMEOUT_S):
        tmp = work["tmp"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline",
               "GLOO_SOCKET_IFNAME": IFNAME}
        self.nodes = [cluster.nodes[k] for k in nodes]
        self.procs, self.lines, self.readers = [], [], []
        for node in self.nodes:
            argv = [str(BIN / "deepspeed"), "--hostfile", str(tmp / hostfile), "--no_ssh", "--node_rank",
                    str(node.rank), "--master_addr", cluster.nodes[0].address, "--master_port", str(MASTER_PORT),
                    "launch/train.py", "--deepspeed_config", str(tmp / ds), "--dist_timeout", str(dist_timeout)]
            argv += args
            proc = subprocess.Popen(node.command(argv, binds=(binds or {}).get(node.rank)), cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            lines: list[str] = []
            reader = threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True)
            reader.start()
            self.procs.append(proc)
            self.lines.append(lines)
            self.readers.append(reader)

    def output(self, i: int) -> str:
        """What the i-th node's launch has printed so far (stdout and stderr)."""
        return "".join(self.lines[i])

    def wait(self, timeout: float = 300) -> list[tuple[int, str]]:
        """(returncode, output) per node; a node still running at `timeout` fails the test."""
        results, deadline = [], time.monotonic() + timeout
        for i, (node, proc) in enumerate(zip(self.nodes, self.procs)):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.kill_all()
                proc.wait()
                self.readers[i].join()
                pytest.fail(f"{node.hostname} still running after {timeout} s:\n{self.output(i)[-4000:]}")
            self.readers[i].join()
            results.append((proc.returncode, self.output(i)))
        return results


def run_ok(launch: Launch) -> list[str]:
    results = launch.wait()
    for rc, out in results:
        assert rc == 0, f"rc {rc}\n{out[-5000:]}"
    return [out for _, out in results]


def two_node_run(cluster, work) -> pathlib.Path:
    """A: the uninterrupted two-node run (once per module)."""
    if "A" not in work["runs"]:
        a = work["tmp"] / "A"
        outs = run_ok(Launch(cluster, work, ["--run_config", str(work["tmp"] / "run.json"), "--data",
                                             str(work["manifest"]), "--output", str(a), "--max_steps", str(STEPS)]))
        work["runs"]["A"] = (a, outs)
    return work["runs"]["A"][0]


def test_two_nodes_train_over_their_own_addresses(cluster, work):
    started = time.monotonic()
    a = two_node_run(cluster, work)
    outs = work["runs"]["A"][1]
    master = f"{cluster.nodes[0].address}:{MASTER_PORT}"
    for node, out in zip(cluster.nodes, outs):
        joined = re.findall(r"\[rank (\d+) @ (\S+)\] joined (\d+) ranks via master (\S+), interface (\S+) \((\S+)\)",
                            out)
        assert joined == [(str(node.rank), node.hostname, "2", master, IFNAME, node.address)], out[-3000:]
    assert [r["step"] for r in metrics(a)] == list(range(1, STEPS + 1))
    assert (a / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert not list(a.glob(".shared-check-*")) and not list(a.glob(".tmp-*"))
    print(f"\ntwo-node run A: {time.monotonic() - started:.1f} s")


def test_node_local_output_is_refused_naming_the_host(cluster, work):
    tmp = work["tmp"]
    out = tmp / "R"
    disks = {k: tmp / f"node{k}_disk" for k in (0, 1)}
    for path in (out, *disks.values()):
        path.mkdir()
    args = ["--run_config", str(tmp / "run.json"), "--data", str(work["manifest"]), "--output", str(out),
            "--max_steps", str(STEPS)]
    binds = {k: {disk: out} for k, disk in disks.items()}
    # node1 first: it waits for the master and says so (every 10 s) until node0 starts
    late = Launch(cluster, work, args, binds=binds, nodes=(1,), dist_timeout=WAITING_TIMEOUT_S)
    deadline = time.monotonic() + 120
    while "waiting for master" not in late.output(0):
        assert time.monotonic() < deadline and late.procs[0].poll() is None, late.output(0)[-3000:]
        time.sleep(0.2)
    results = Launch(cluster, work, args, binds=binds, nodes=(0,), dist_timeout=WAITING_TIMEOUT_S).wait() + late.wait()
    waiting = re.findall(r"\[rank 1 @ node1\] waiting for master (\S+) \(rank 0\) \.\.\. (\d+) s", results[1][1])
    assert waiting and all(master == f"{cluster.nodes[0].address}:{MASTER_PORT}" for master, _ in waiting), waiting
    print(f"\nnode1, started first, printed {[f'{s} s' for _, s in waiting]} while it waited for node0")
    assert all(rc != 0 for rc, _ in results), [rc for rc, _ in results]
    errors = [line for line in results[0][1].splitlines() if "launch/train.py: error:" in line]
    assert len(errors) == 1, results[0][1][-4000:]
    assert f"--output {out} is not one shared filesystem: rank 0 on node0 cannot see the markers that " \
           f"node1 (ranks 1) wrote" in errors[0]
    for k, disk in disks.items():  # nothing trained, no marker left behind on either node's disk
        assert list(disk.iterdir()) == [], (k, list(disk.iterdir()))
    assert list(out.iterdir()) == []


def test_a_lost_node_stops_node0_in_bound_and_the_resume_is_exact(cluster, work):
    want = metrics(two_node_run(cluster, work))
    tmp, k_dir = work["tmp"], work["tmp"] / "K"
    launch = Launch(cluster, work, ["--run_config", str(tmp / "run.json"), "--data", str(work["manifest"]),
                                    "--output", str(k_dir), "--max_steps", str(STEPS)])
    deadline = time.monotonic() + 240
    while not ((k_dir / "latest").is_file() and (k_dir / "latest").read_text().strip() == "step_00000002"):
        assert time.monotonic() < deadline and launch.procs[0].poll() is None, "step 2's checkpoint never came"
        time.sleep(0.05)  # step 2 is saved: the ranks are in step 3
    node1 = cluster.nodes[1]
    node1.cut_cable()  # the machine is gone: nothing more from it reaches node0
    killed = node1.kill_all()
    lost_at = time.monotonic()
    rc0 = None
    try:
        rc0 = launch.procs[0].wait(timeout=STOP_BOUND_S + 60)
    except subprocess.TimeoutExpired:
        pass
    stopped_after = time.monotonic() - lost_at
    launch.procs[1].wait()
    cluster.nodes[0].kill_all()  # a hang would leave node0's ranks: end them before the next launch
    launch.procs[0].wait()
    launch.readers[0].join()
    out0 = launch.output(0)
    subprocess.run(["/usr/sbin/ip", "-n", node1.netns, "link", "set", IFNAME, "up"], check=True)
    error = next((line for line in out0.splitlines() if "launch/train.py: error:" in line), None)
    print(f"\nnode lost with {len(metrics(k_dir))} steps logged ({len(killed)} processes of node1 SIGKILLed): "
          f"node0 stopped after {stopped_after:.1f} s (bound {STOP_BOUND_S} s, --dist_timeout {DIST_TIMEOUT_S}):"
          f"\n{error}")
    assert rc0 is not None, f"node0 still running {stopped_after:.0f} s after node1 was lost"
    assert rc0 != 0 and stopped_after <= STOP_BOUND_S, (rc0, stopped_after, out0[-3000:])
    assert "launch/train.py: error: rank 0: lost contact with a peer rank" in out0, out0[-3000:]

    from ds_ttt.train.checkpoint import resolve_checkpoint
    kept = resolve_checkpoint(k_dir)  # `latest` names a complete checkpoint
    assert (kept / "COMPLETE").is_file(), kept

    run_ok(Launch(cluster, work, ["--resume", str(k_dir)]))
    got = metrics(k_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        for key in ("loss", "action_loss", "lr", "tokens"):
            assert b[key] == a[key], (a["step"], key, a[key], b[key])  # bit for bit
    print(f"resumed from {kept.name} on two nodes: losses equal to A's bit for bit: {[r['loss'] for r in got]}")


def test_move_off_a_node(cluster, work):
    tmp = work["tmp"]
    b, moved = tmp / "B", tmp / "M"
    started = time.monotonic()
    outs = run_ok(Launch(cluster, work, ["--run_config", str(tmp / "run.json"), "--data", str(work["manifest"]),
                                         "--output", str(b), "--max_steps", str(MOVE_STEPS)],
                         hostfile="hostfile_2x2", ds="pp1_dp4.json"))
    took_b = time.monotonic() - started
    master = f"{cluster.nodes[0].address}:{MASTER_PORT}"
    for node, out in zip(cluster.nodes, outs):  # ranks numbered node by node: 0-1 on node0, 2-3 on node1
        joined = re.findall(r"\[rank (\d+) @ (\S+)\] joined (\d+) ranks via master (\S+), interface (\S+) \((\S+)\)",
                            out)
        assert sorted(joined) == [(str(2 * node.rank + k), node.hostname, "4", master, IFNAME, node.address)
                                  for k in (0, 1)], out[-3000:]
    assert [r["step"] for r in metrics(b)] == list(range(1, MOVE_STEPS + 1))

    started = time.monotonic()
    log = run_ok(Launch(cluster, work, ["--resume", str(b / "step_00000001"), "--output", str(moved)],
                        hostfile="hostfile_1x2", ds="pp2_dp1.json", nodes=(0,)))[0]
    took_m = time.monotonic() - started
    assert "DeepSpeed universal checkpoint" in log, log[-3000:]
    want, got = metrics(b)[1:], metrics(moved)
    assert [r["step"] for r in got] == list(range(2, MOVE_STEPS + 1))
    diffs = []
    for x, y in zip(want, got):
        assert y["lr"] == x["lr"] and y["tokens"] == x["tokens"]
        diffs.append(abs(y["loss"] - x["loss"]) / abs(x["loss"]))
        assert y["loss"] == pytest.approx(x["loss"], rel=LOSS_RTOL, abs=0), (x["loss"], y["loss"])
    print(f"\nB on 2 nodes x 2 (PP1 x DP4): {took_b:.1f} s; moved to 1 node x 2 (PP2 x DP1): {took_m:.1f} s; "
          f"relative loss differences at steps 2-{MOVE_STEPS} {['%.2e' % d for d in diffs]} "
          f"(tolerance {LOSS_RTOL:.2e}); losses B {[x['loss'] for x in want]}, M {[y['loss'] for y in got]}")
