"""Two machines on one: each node a Linux network namespace with its own IPv4 address and hostname,
joined by a veth pair (a cable), for tests/e2e/test_multinode.py.

    node0 (netns dsttt<pid>n0)                     node1 (netns dsttt<pid>n1)
      lo, ttt0 10.77.<k>.1/24  <---- veth pair ---->  lo, ttt0 10.77.<k>.2/24

Both ends are named `ttt0` (each namespace has its own interface names, as every node of a cluster
has its own `eth0`), so one GLOO_SOCKET_IFNAME=ttt0 serves every node. Each namespace has its own
loopback: ranks on different nodes can reach each other only through the veth pair. A command runs on
a node through `ip netns exec` + `unshare --uts --mount` (its own hostname, and optionally its own
folders bind-mounted over shared paths: a node-local disk). Needs root; `Cluster.unavailable()` says
why namespaces cannot be made here (the test skips with that reason).

    with Cluster.create(2) as cluster:
        subprocess.run(cluster.nodes[1].command(["hostname"]))              # -> node1
        cluster.nodes[1].kill_all(); cluster.nodes[1].cut_cable()          # a lost node
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import shutil
import signal
import subprocess

IP = shutil.which("ip") or "/usr/sbin/ip"
IFNAME = "ttt0"


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True)


@dataclasses.dataclass
class Node:
    rank: int
    netns: str
    hostname: str
    address: str

    def command(self, argv: list[str], *, binds: dict[pathlib.Path, pathlib.Path] | None = None) -> list[str]:
        """argv run on this node: in its network namespace, with its hostname, each `binds` source
        folder mounted over its target path (visible to this node only)."""
        steps = [f"hostname {shlex.quote(self.hostname)}"]
        steps += [f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}" for src, dst in (binds or {}).items()]
        script = " && ".join(steps) + " && exec " + shlex.join(argv)
        return [IP, "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script]

    def pids(self) -> list[int]:
        out = subprocess.run([IP, "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of this node (its launcher and every rank), as a crash would."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def cut_cable(self) -> None:
        """Take this node's end of the link down: its peers hear nothing more from it (no FIN, no RST)."""
        _ip("-n", self.netns, "link", "set", IFNAME, "down")


@dataclasses.dataclass
class Cluster:
    nodes: list[Node]

    @staticmethod
    def unavailable() -> str | None:
        """Why two namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "needs root to make network namespaces (ip netns add)"
        if not pathlib.Path(IP).exists():
            return f"iproute2 is not installed ({IP} missing): run setup.sh or apt-get install iproute2"
        if shutil.which("unshare") is None:
            return "util-linux unshare is not installed"
        probe = f"dsttt{os.getpid()}probe"
        try:
            _ip("netns", "add", probe)
            subprocess.run([IP, "netns", "exec", probe, "unshare", "--uts", "--mount", "true"], check=True,
                           capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            return f"cannot make a network namespace here: {' '.join(map(str, e.cmd))}: {e.stderr.strip()}"
        finally:
            subprocess.run([IP, "netns", "del", probe], capture_output=True)
        return None

    @classmethod
    def create(cls, num_nodes: int = 2) -> "Cluster":
        assert num_nodes == 2, "one veth pair joins two nodes"
        tag = f"dsttt{os.getpid()}"
        subnet = 10 + os.getpid() % 200  # one /24 per test process: parallel sessions do not collide
        nodes = [Node(k, f"{tag}n{k}", f"node{k}", f"10.77.{subnet}.{k + 1}") for k in range(num_nodes)]
        cluster = cls(nodes)
        try:
            ends = [f"{tag}{'ab'[k]}"[-15:] for k in range(num_nodes)]
            for node in nodes:
                _ip("netns", "add", node.netns)
            _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
            for node, end in zip(nodes, ends):
                _ip("link", "set", end, "netns", node.netns)
                _ip("-n", node.netns, "link", "set", end, "name", IFNAME)
                _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", IFNAME)
                _ip("-n", node.netns, "link", "set", IFNAME, "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
        except BaseException:
            cluster.destroy()
            raise
        return cluster

    def hostfile(self, slots: int) -> str:
        return "".join(f"{node.hostname} slots={slots}\n" for node in self.nodes)

    def destroy(self) -> None:
        for node in self.nodes:
            node.kill_all()
            subprocess.run([IP, "netns", "del", node.netns], capture_output=True)  # removes the veth pair too

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
