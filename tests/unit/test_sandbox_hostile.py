"""The hostile-command suite against the generator's `Sandbox` and the serve runner's `BashToolRunner`.

    .venv/bin/python -m pytest tests/unit/test_sandbox_hostile.py -q

Every attack of tests/unit/hostile.py (chroot and pivot_root escapes, /proc/1/root, /proc/<host pid>,
ptrace, mount, setuid binaries, Unix sockets in /dev/shm, /run and /tmp, an abstract socket, loopback
TCP to a server this test starts, fork and memory bombs, disk fill, output flood, writes outside the
root, reading a host file outside the binds) runs in a fresh sandbox of each place and must fail: the
secret never shows, no host server sees a connection, the sentinel tree's hash is unchanged, nothing
appears at the host paths written to, and the attack's own check holds. tests/harbor/ runs the same
attacks through Harbor's `SandboxEnvironment`. The sandboxes here use small disk and file caps (the
same tmpfs and RLIMIT_FSIZE mechanism as the defaults) so a fill costs 64 MiB, not 1 GiB.

The resource attacks (hostile.RESOURCE_ATTACKS: 8 processes x 100 MiB, a fork storm, spinners on every
core, every tmpfs filled) run in both places under small episode caps (256 MiB, 40 processes, half a
core) and are judged from the host by `ResourceWatch`, which also kills an attack whose memory passes
twice the cap. Against the sandbox before the per-episode cgroup caps (no cgroup; run without the max_episode_* options
it lacks) the memory attack, the fork storm and the spinners get through; the tmpfs sizes held there.
"""

import inspect
import json
import os
import re
import threading
import time

import pytest

from ds_ttt.sandbox import Sandbox, format_observation, probe, process, shell
from ds_ttt.sandbox.kill import process_tree
from ds_ttt.serve.tools import BashToolRunner

from hostile import (ATTACKS, RESOURCE_ATTACKS, RESOURCE_LIMITS, WRITABLE_MOUNTS, HostTargets, ResourceWatch, command,
                     extra_check)

pytestmark = pytest.mark.skipif(not probe.network_isolation_available(),
                                reason=f"bubblewrap sandbox unavailable here: {probe.isolation_problem()}")
LIMITS = {"max_disk_bytes": 64 << 20, "max_scratch_bytes": 16 << 20, "max_file_bytes": 32 << 20}
TIMEOUT = 8.0


@pytest.fixture(scope="module")
def targets():
    with HostTargets() as t:
        yield t


class GeneratorPlace:
    """The generator's `Episode.act` calls `Sandbox.run`: the same call, output unformatted."""

    def __init__(self, limits=LIMITS):
        self.sb = Sandbox(timeout=TIMEOUT, **limits)

    def run(self, cmd: str) -> str:
        return self.sb.run(cmd).output

    def observe(self, cmd: str) -> str:  # what Episode.act puts in the trajectory
        return format_observation(self.sb.run(cmd), max_chars=50_000)

    def close(self):
        self.sb.close()


class RunnerPlace:
    def __init__(self, limits=LIMITS):
        self.runner = BashToolRunner(timeout=TIMEOUT, max_output_chars=50_000, **limits)
        self.sb = self.runner.sandbox

    def run(self, cmd: str) -> str:
        return self.runner.execute({"function": {"name": "bash", "arguments": json.dumps({"command": cmd})}})

    observe = run

    def close(self):
        self.runner.close()


PLACES = {"generator": GeneratorPlace, "runner": RunnerPlace}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("place", sorted(PLACES))
def test_attack_fails(place, attack, targets):
    p = PLACES[place]()
    peak, stop = [0], threading.Event()

    def watch():  # the sandbox's process count, seen from the host
        while not stop.is_set():
            if p.sb.pid is not None:
                peak[0] = max(peak[0], len(process_tree(p.sb.pid)))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        t0 = time.monotonic()
        out = p.run(command(attack, targets.fields(os.getpid())))
        took = time.monotonic() - t0
        after = p.run("echo alive")
        # the sandbox kills the bomb's processes when the command ends; their exits are reaped
        # asynchronously, so wait (bounded) for the count to settle before judging it
        deadline = time.monotonic() + 10.0
        left = len(process_tree(p.sb.pid))
        while left > 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            left = len(process_tree(p.sb.pid))
    finally:
        stop.set()
        watcher.join()
        p.close()
    assert targets.failures(out) == [], out[-3000:]
    assert extra_check(attack, out), out[-3000:]
    assert after.startswith("alive"), after  # the sandbox still answers
    if attack == "fork_bomb":
        # RLIMIT_NPROC (MAX_PROCESSES) stops the bomb first, but the kernel's check races concurrent forks
        # (a CI run on 2 loaded cores saw 260); the hard cap is the episode cgroup's pids.max
        cap = shell.EPISODE_PROCESSES if p.sb.cgroup_caps != "none" else shell.MAX_PROCESSES
        assert peak[0] <= cap + 2, (peak[0], p.sb.cgroup_caps)  # + bwrap's PID 1 and nothing else
        assert "Resource temporarily unavailable" in out or "retry" in out, out[-2000:]
        assert left <= 3, left  # the bomb is gone: PID 1, the shell (and `echo`'s leftovers none)
    if attack == "output_flood":
        assert took < 5.0 and "HOSTILE_FLOOD" in out and len(out) <= shell.MAX_OUTPUT_BYTES + 200
    if attack == "disk_fill":
        assert "No space left on device" in out, out[-2000:]
        used_kib = re.search(r"^tmpfs\s+\d+\s+(\d+)\s+\d+\s+\d+%\s+/app$", out, re.M)
        assert used_kib and int(used_kib.group(1)) <= LIMITS["max_disk_bytes"] // 1024, out[-2000:]  # df -k .


def test_the_suite_can_fail(targets):
    """The same checks catch an attack that works: without bubblewrap the secret is readable, the
    loopback server answers and the sentinel can be written."""
    with Sandbox(timeout=TIMEOUT, isolation="none") as sb:
        f = targets.fields(os.getpid())
        assert targets.token in sb.run(command("read_host_files", f)).output
        out = sb.run(command("loopback_tcp", f)).output
        assert targets.token in out and targets.connections >= 1
        targets.connections = 0
        sb.run(f"echo x > {f['sentinel']}/sub/keep.txt")
        assert targets.tree_hash() != targets.hash_before
        (targets.sentinel / "sub" / "keep.txt").write_text("do not touch\n")
        assert targets.tree_hash() == targets.hash_before


def test_a_background_fork_bomb_never_outlives_its_command():
    """A bomb still below the process limit when its command ends used to grow afterwards, keep its
    processes and print its "fork: retry" noise into the next commands (the old 90% check, once)."""
    from ds_ttt.sandbox import Sandbox

    with Sandbox(parent="/tmp") as sb:
        for _ in range(4):
            sb.run(":(){ :|:& };: ; sleep 0.5; echo done", timeout=5)
            after = sb.run("echo alive", timeout=5)
            assert after.output == "alive\n", after.output[:200]
            assert len(process_tree(sb.pid)) <= 3



STOPS = {  # command, Sandbox.run timeout, rounds, what the result says
    "process limit": ("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 30 & done; sleep 30 | cat & echo started",
                      TIMEOUT, 3, lambda r: r.output == "started\n" and r.process_limit_hit),
    "timeout": ("sleep 30 & sleep 30 | cat & echo started; sleep 100", 0.5, 10,
                lambda r: r.output == "started\n" and r.timed_out),
}


@pytest.mark.parametrize("stop", sorted(STOPS))
def test_the_hosts_kills_leave_no_job_notices_in_the_next_command(stop):
    """Jobs the sandbox kills (at its process limit after their command ended, or at a timeout) are
    jobs of the episode's shell: bash used to print "Killed  sleep 30" notices of them into the next
    command's output (the fork-bomb case above failed so in CI: `after` began "bash: line 1: 3 Done
    bomb"; at a timeout 14 of 30 rounds leaked under load). The result of the command that started
    them says what happened; the next command's output is its own."""
    command, timeout, rounds, says = STOPS[stop]
    with Sandbox(parent="/tmp", max_processes=32, timeout=TIMEOUT) as sb:  # killed from 8 processes on
        for _ in range(rounds):
            res = sb.run(command, timeout=timeout)
            assert says(res), (res.output, res.process_limit_hit, res.timed_out)
            after = sb.run("echo alive")
            assert after.output == "alive\n", after.output[:400]
            assert len(process_tree(sb.pid)) <= 2


def test_a_late_reap_answer_is_skipped_not_misread(monkeypatch):
    """On a loaded machine the shell can answer the reap after the host stopped waiting for it (CI, load
    20 during the fork-bomb tests: the first reap treated that as a dead shell and stopped the sandbox).
    A late answer must cost nothing: the next command gets its own status and output, no restart."""
    monkeypatch.setattr(process, "KILL_GRACE_SEC", 0.0)  # the host never waits for the answer
    with Sandbox(parent="/tmp", max_processes=32, timeout=TIMEOUT) as sb:
        for _ in range(3):
            assert sb.run(STOPS["process limit"][0]).process_limit_hit
            after = sb.run("echo alive; (exit 3)")
            assert (after.output, after.exit_code, after.shell_restarted) == ("alive\n", 3, False)
            assert sb.pid is not None and sb.num_restarts == 0


def resource_options() -> dict:
    """RESOURCE_LIMITS, less any option this `Sandbox` lacks (the sandbox before the per-episode cgroup caps had no max_episode_*
    options: it runs without them, and the host-side checks judge it the same way)."""
    params = inspect.signature(Sandbox).parameters
    return {k: v for k, v in RESOURCE_LIMITS.items() if k in params}


def df_rows(out: str) -> dict[str, tuple[int, int]]:
    """{mount: (size KiB, used KiB)} from `df -k` lines."""
    rows = {}
    for m in re.finditer(r"^\S+\s+(\d+)\s+(\d+)\s+\d+\s+\d+%\s+(\S+)$", out, re.M):
        rows[m.group(3)] = (int(m.group(1)), int(m.group(2)))
    return rows


@pytest.mark.parametrize("attack", sorted(RESOURCE_ATTACKS))
@pytest.mark.parametrize("place", sorted(PLACES))
def test_resource_attack_is_capped_for_the_whole_episode(place, attack):
    """Each attack stays under every per-process limit; what the whole episode gets is judged from the
    host: its processes' memory (peak of the sum), their number, their CPU time per wall second."""
    memory_cap, processes_cap = RESOURCE_LIMITS["max_episode_memory_bytes"], RESOURCE_LIMITS["max_episode_processes"]
    cpus_cap = RESOURCE_LIMITS["max_episode_cpus"]
    p = PLACES[place](resource_options())
    group = getattr(p.sb, "_cgroup", None)
    cgroup_dirs = group._dirs() if group is not None else []
    cpu_rate = cgroup_cpu_rate = memory_in_cgroup = None
    try:
        with ResourceWatch(lambda: p.sb.pid,
                           kill_above=2 * memory_cap) as watch:
            out = p.observe(RESOURCE_ATTACKS[attack])
            if attack == "busy_cores":  # the spinners run on in the background: measure them over 1.5 s
                kernel = group is not None and group.cpu_seconds() is not None  # the cgroup's own account, too
                c0, k0, t0 = watch.cpu_seconds(), group.cpu_seconds() if kernel else 0.0, time.monotonic()
                time.sleep(1.5)
                cpu_rate = (watch.cpu_seconds() - c0) / (time.monotonic() - t0)
                if kernel:
                    cgroup_cpu_rate = (group.cpu_seconds() - k0) / (time.monotonic() - t0)
            if attack == "tmpfs_fill" and group is not None:
                memory_in_cgroup = group.memory_bytes()  # tmpfs pages are charged to the episode
            after = p.observe("echo alive")
    finally:
        p.close()
    # The watch's walk of /proc is not atomic (a process that ends during it may be counted beside the one
    # that replaced it), so it is allowed a little over the caps: the attacks take 3x the memory, 1.5x the processes
    assert watch.killed == "", (watch.killed, out[-2000:])
    assert watch.peak_memory <= memory_cap + (16 << 20), (watch.peak_memory >> 20, out[-2000:])
    assert watch.peak_processes <= processes_cap + 4, (watch.peak_processes, out[-2000:])
    assert after.startswith("alive"), after[-1000:]  # the sandbox still answers (the shell may have been restarted)
    if attack == "memory_many_processes":
        assert "all survived" not in out
        assert f"[command killed: the sandbox reached its memory limit of {memory_cap >> 20} MiB]" in out, out[-2000:]
    if attack == "busy_cores":
        assert cpu_rate <= cpus_cap + 0.15, cpu_rate  # a CFS quota holds to a period (100 ms); 1.5 s of samples
        assert cgroup_cpu_rate is None or cgroup_cpu_rate <= cpus_cap + 0.1, cgroup_cpu_rate
    if attack == "tmpfs_fill":
        rows = df_rows(out)
        assert sorted(rows) == sorted(WRITABLE_MOUNTS), out[-2000:]
        for mount, (size_kib, used_kib) in rows.items():
            assert used_kib <= size_kib and size_kib - used_kib < 4096, (mount, size_kib, used_kib)  # full, not over
        if memory_in_cgroup is not None:
            assert memory_in_cgroup <= memory_cap, memory_in_cgroup
    assert [d for d in cgroup_dirs if d.exists()] == []  # the episode's cgroup went with it
