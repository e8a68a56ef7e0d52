"""Each sandbox's episode runs in a cgroup of its own: caps set, every process inside, gone at close; refusal without.

    .venv/bin/python -m pytest tests/unit/test_sandbox_cgroup.py -q

The real tests (skipped where this process cannot make cgroups) check from the host that the caps are
written where the kernel reads them, that every process of the sandbox is a member before its first
command, that an OOM kill stops the command with a note and keeps the shell (or restarts it, files
kept), and that close removes the cgroup even after kills and kills what left the process tree.
Refusal is tested twice: with the cgroup root pointed at an empty directory, and for real as an
unprivileged user (uid 65534) against this machine's cgroups. The v2, v1 and systemd ways are also
checked against fake cgroup trees (what is written where) and, for systemd, the command built.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_ttt.data.cli import generate_main
from ds_ttt.data.generator import generate
from ds_ttt.sandbox import CommandResult, Sandbox, SandboxError, format_observation, probe
from ds_ttt.sandbox import caps as cg
from ds_ttt.sandbox.kill import process_tree
from ds_ttt.serve.tools import BashToolRunner

REPO = Path(__file__).resolve().parents[2]
needs_cgroups = pytest.mark.skipif(probe.cgroup_problem() is not None,
                                   reason=f"no cgroup can be made here: {probe.cgroup_problem()}")
SMALL = {"max_disk_bytes": 16 << 20, "max_scratch_bytes": 16 << 20, "max_episode_memory_bytes": 256 << 20,
         "isolation": "none"}  # "none": these tests are about the cgroup, which both isolations get
# 300 MiB of touched memory held by a child of the shell (a 256 MiB cap kills it)
HOG = "python3 -c 'import time; b = b\"x\" * (300 << 20); time.sleep(30)'"


def members(group) -> set[int]:
    return set(group.pids())


def gone(pid: int, wait_sec: float = 5.0) -> bool:
    """Has `pid` ended (a zombie waiting for a parent outside counts as ended)?"""
    deadline = time.monotonic() + wait_sec
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- the caps, from the host
@needs_cgroups
@pytest.mark.parametrize("isolation", ["required", "none"])
def test_caps_are_set_and_every_process_is_inside_before_the_first_command(isolation):
    if isolation == "required" and not probe.network_isolation_available():
        pytest.skip("bubblewrap unavailable here")
    with Sandbox(parent="/tmp", isolation=isolation, max_episode_memory_bytes=2 << 30, max_episode_processes=64,
                 max_episode_cpus=0.25) as sb:
        group = sb.cgroup
        assert sb.cgroup_caps == group.backend in ("cgroup-v1", "cgroup-v2", "systemd")
        res = sb.run("cat /proc/self/cgroup; echo $$")
        tree = {pid for pid, _start in process_tree(sb.pid)} | {sb.pid}
        assert tree - {os.getpid()} <= members(group), (tree, members(group))  # bwrap, PID 1, the shell, `cat`'s shell
        if group.backend == "cgroup-v1":
            d = group.dirs
            assert (d["memory"] / "memory.limit_in_bytes").read_text().strip() == str(2 << 30)
            if (d["memory"] / "memory.memsw.limit_in_bytes").exists():
                assert (d["memory"] / "memory.memsw.limit_in_bytes").read_text().strip() == str(2 << 30)  # no swap
            assert (d["pids"] / "pids.max").read_text().strip() == "64"
            assert (d["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert (d["cpu"] / "cpu.cfs_period_us").read_text().strip() == "100000"
            memory_line = next(line for line in res.output.splitlines() if ":memory:" in line)
            assert memory_line.endswith("/" + d["memory"].name), res.output  # as the shell itself sees it
        elif group.backend == "cgroup-v2":
            assert (group.path / "memory.max").read_text().strip() == str(2 << 30)
            assert (group.path / "pids.max").read_text().strip() == "64"
            assert (group.path / "cpu.max").read_text().split() == ["25000", "100000"]
        dirs = group._dirs()
        assert dirs and all(d.is_dir() for d in dirs)
    assert [d for d in dirs if d.exists()] == []


@needs_cgroups
def test_a_command_at_the_memory_cap_is_killed_and_noted_and_the_shell_lives_on():
    with Sandbox(parent="/tmp", timeout=20, **SMALL) as sb:
        sb.run("cd /tmp && export KEEP=1 && echo kept > file")
        # `sleep 10` after the hog: the host polls for the kill every OOM_POLL_SEC, so the line must outlast that
        # for the stop to be certain (test_a_line_that_ends_before_the_kill_is_seen... covers the race)
        res = sb.run(f"echo before; {HOG}; sleep 10; echo after")
        assert res.memory_limit_hit and res.exit_code == 137 and not res.shell_restarted, res
        # the rest of the command line was abandoned, as at a timeout (bash's notice of the killed hog may come
        # before the stop: "bash: line 1: N Killed  python3 ...")
        lines = res.output.splitlines()
        assert lines[0] == "before" and all("Killed" in line for line in lines[1:]) and "after" not in res.output, res
        obs = format_observation(res)
        assert obs.endswith("[exit code: 137]\n[command killed: the sandbox reached its memory limit of 256 MiB]"), obs
        again = sb.run("echo $KEEP; pwd; cat file")  # the same shell: variables, directory, files
        assert (again.output, again.memory_limit_hit) == ("1\n/tmp\nkept\n", False), again


@needs_cgroups
def test_a_line_that_ends_before_the_kill_is_seen_still_reports_the_kill():
    """`hog; echo after` can finish within one OOM poll of the kill (it did in CI at load 50): either the stop
    came in time (137, nothing after) or the line's own status and output stand; the kill is reported both ways."""
    with Sandbox(parent="/tmp", timeout=20, **SMALL) as sb:
        res = sb.run(f"{HOG}; echo after")
        assert res.memory_limit_hit and not res.shell_restarted, res
        obs = format_observation(res)
        if res.exit_code == 137:
            assert res.output == "" and obs.endswith("[command killed: the sandbox reached its memory limit of 256 MiB]")
        else:
            # bash's own notice of the killed foreground process may come first ("bash: line 1: N Killed ...")
            assert res.exit_code == 0 and res.output.endswith("after\n"), res
            assert obs.endswith("after\n[a process of this command was killed: the sandbox reached its memory limit of 256 MiB]")
        assert sb.run("echo alive").output == "alive\n"


@needs_cgroups
def test_a_shell_killed_at_the_memory_cap_is_restarted_with_its_files():
    """A string built in the shell (printf -v; a command substitution alike) is the shell's memory, so the OOM
    killer takes the shell itself."""
    with Sandbox(parent="/tmp", timeout=20, **SMALL) as sb:
        sb.run("echo kept > file")
        res = sb.run("printf -v x '%300000000s' ''; echo ${#x}")
        assert res.memory_limit_hit and res.shell_restarted and not res.files_lost, res
        assert sb.run("cat file").output == "kept\n"


@needs_cgroups
def test_a_background_job_killed_at_the_cap_is_noted_in_the_next_result():
    with Sandbox(parent="/tmp", timeout=20, **SMALL) as sb:
        assert sb.run(f"({HOG}) & echo started").output == "started\n"
        deadline = time.monotonic() + 15
        while sb.cgroup.oom_kills() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        res = sb.run("echo next")
        assert res.memory_limit_earlier and not res.memory_limit_hit, res
        # bash may already have written its own notice of the job ("bash: line 1: N Killed ( python3 ... )") before
        # this command was sent; nothing else may come before the command's output
        assert [line for line in res.output.splitlines() if "Killed" not in line] == ["next"], res
        assert "after the previous command]" in format_observation(res)
        assert not sb.run("true").memory_limit_earlier  # noted once


@needs_cgroups
def test_the_cgroup_is_removed_after_kills_and_takes_escaped_processes_with_it():
    """Without bubblewrap, `setsid` + reparenting takes a process out of the sandbox's process tree, so the
    tree walk at close misses it (it outlived the sandbox before); the cgroup still holds it."""
    sb = Sandbox(parent="/tmp", timeout=1, **SMALL)
    res = sb.run("(setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!); sleep 5")  # the subshell exits: reparented
    assert res.timed_out
    escaped = int(res.output.split()[0])
    try:
        assert escaped not in {pid for pid, _ in process_tree(sb.pid)} and escaped in members(sb.cgroup)
        dirs = sb.cgroup._dirs()
    finally:
        sb.close()
    assert [d for d in dirs if d.exists()] == []
    assert gone(escaped)


# ---------------------------------------------------------------- refusal and the explicit opt-out
@pytest.fixture()
def no_cgroups_here(monkeypatch, tmp_path):
    empty = tmp_path / "cgroupfs"
    empty.mkdir()
    empty.chmod(0o555)
    monkeypatch.setattr(cg, "CGROUP_ROOT", str(empty))
    monkeypatch.setattr(cg, "_systemd_available", lambda: False)
    probe.cgroup_problem.cache_clear()
    yield empty
    probe.cgroup_problem.cache_clear()


def test_without_a_cgroup_the_sandbox_refuses_with_the_fix(no_cgroups_here, tmp_path):
    parent = tmp_path / "sandboxes"
    parent.mkdir()
    with pytest.raises(SandboxError) as e:
        Sandbox(parent=str(parent), isolation="none")
    msg = str(e.value)
    assert "cannot cap the episode's memory, processes and CPU" in msg and str(no_cgroups_here) in msg  # why
    assert "run as root" in msg and "Delegate=yes" in msg  # the fixes
    assert "--no-cgroup-caps" in msg and "cgroup_caps='none'" in msg and "cgroup_caps=none" in msg  # the opt-out
    assert list(parent.iterdir()) == []  # nothing left behind
    with Sandbox(parent=str(parent), isolation="none", cgroup_caps="none") as sb:  # the explicit choice works
        assert sb.cgroup_caps == "none" and sb.run("echo hi").output == "hi\n"
    with pytest.raises(SandboxError, match="--no-cgroup-caps"):
        BashToolRunner(timeout=1, isolation="none")
    with BashToolRunner(timeout=1, isolation="none", cgroup_caps="none") as runner:
        assert runner.cgroup_caps == "none"


def test_the_generator_refuses_and_records_the_caps_used(no_cgroups_here, tmp_path, capsys):
    with pytest.raises(SandboxError, match="--no-cgroup-caps"):
        generate(2, 0, workers=1, isolation="none")
    assert generate_main(["--out", str(tmp_path / "g"), "--num", "2", "--seed", "0", "--workers", "1",
                          "--no-token-stats", "--no-isolation"]) == 2
    assert "--no-cgroup-caps" in capsys.readouterr().err and not (tmp_path / "g").exists()
    assert generate_main(["--out", str(tmp_path / "g"), "--num", "2", "--seed", "0", "--workers", "1",
                          "--no-token-stats", "--no-isolation", "--no-cgroup-caps"]) == 0
    captured = capsys.readouterr()
    assert "warning: --no-cgroup-caps" in captured.err and "cgroup caps none" in captured.out
    trajs = [json.loads(line) for line in (tmp_path / "g" / "trajectories.jsonl").read_text().splitlines()]
    assert [t["meta"]["cgroup_caps"] for t in trajs] == ["none", "none"]


@needs_cgroups
def test_the_generator_records_the_cgroup_it_used(tmp_path):
    trajs = generate(1, 0, workers=1, isolation="none")
    assert trajs[0]["meta"]["cgroup_caps"] in ("cgroup-v1", "cgroup-v2", "systemd")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become uid 65534")
def test_an_unprivileged_user_without_delegation_is_refused_for_real():
    """uid 65534 cannot create a cgroup under this machine's hierarchies: the sandbox says so and how to fix it."""
    code = ("import os\nfrom ds_ttt.sandbox import Sandbox, SandboxError\n"
            "os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)\n"  # after the imports
            "try:\n Sandbox(parent='/tmp', isolation='none'); print('MADE')\n"
            "except SandboxError as e: print(e)\n"
            "with Sandbox(parent='/tmp', isolation='none', cgroup_caps='none') as sb: print(sb.run('echo ok').output)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/tmp",
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    if cg._systemd_available():
        pytest.skip("systemd runs here: the unprivileged user gets a scope")
    assert "MADE" not in out.stdout and "cannot create the cgroup" in out.stdout and "--no-cgroup-caps" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("ok")


def test_bad_caps_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"max_episode_memory_bytes=.*tmpfs mounts.*max_disk_bytes"):
        Sandbox(parent=str(tmp_path), isolation="none", max_episode_memory_bytes=512 << 20)  # 1 GiB workdir
    with pytest.raises(ValueError, match="max_episode_cpus"):
        Sandbox(parent=str(tmp_path), isolation="none", max_episode_cpus=0)
    with pytest.raises(ValueError, match="max_episode_processes"):
        Sandbox(parent=str(tmp_path), isolation="none", max_episode_processes=2)
    with pytest.raises(ValueError, match="cgroup_caps='maybe'"):
        Sandbox(parent=str(tmp_path), isolation="none", cgroup_caps="maybe")
    assert list(tmp_path.iterdir()) == []


def test_memory_notes_in_the_observation():
    hit = CommandResult("x", "partial\n", 137, memory_limit_hit=True, memory_limit_bytes=256 << 20)
    assert format_observation(hit) == ("partial\n[exit code: 137]\n"
                                       "[command killed: the sandbox reached its memory limit of 256 MiB]")
    ended_first = CommandResult("x", "after\n", 0, memory_limit_hit=True, memory_limit_bytes=256 << 20)
    assert format_observation(ended_first) == ("after\n[a process of this command was killed: the sandbox reached "
                                               "its memory limit of 256 MiB]")
    earlier = CommandResult("x", "ok\n", 0, memory_limit_earlier=True, memory_limit_bytes=4 << 30)
    assert format_observation(earlier) == ("ok\n[a background process was killed: the sandbox reached its memory "
                                           "limit of 4096 MiB after the previous command]")


# ---------------------------------------------------------------- the three ways, on fake trees
CAPS = cg.CgroupCaps(memory_bytes=300 << 20, processes=50, cpus=1.5)


def fake_proc_cgroup(monkeypatch, tmp_path, text: str) -> None:
    f = tmp_path / "proc_self_cgroup"
    f.write_text(text)
    monkeypatch.setattr(cg, "PROC_SELF_CGROUP", str(f))


def test_v2_writes_the_caps_in_a_child_of_the_current_cgroup(monkeypatch, tmp_path):
    own = tmp_path / "fs" / "user.slice" / "me"
    own.mkdir(parents=True)
    (tmp_path / "fs" / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text("\n")
    fake_proc_cgroup(monkeypatch, tmp_path, "0::/user.slice/me\n")
    group = cg.create_episode_cgroup("ep1", CAPS, root=str(tmp_path / "fs"))
    assert isinstance(group, cg.V2Cgroup) and group.backend == "cgroup-v2" and group.path == own / "ep1"
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert {f: (own / "ep1" / f).read_text() for f in ("memory.max", "pids.max", "cpu.max")} == {
        "memory.max": str(300 << 20), "pids.max": "50", "cpu.max": "150000 100000"}


def test_v2_without_the_controllers_falls_through_to_systemd_then_refuses(monkeypatch, tmp_path):
    (tmp_path / "fs").mkdir()
    (tmp_path / "fs" / "cgroup.controllers").write_text("\n")  # v2 mounted, nothing delegated (as beside v1 here)
    (tmp_path / "fs" / "cgroup.subtree_control").write_text("\n")
    fake_proc_cgroup(monkeypatch, tmp_path, "0::/\n")
    monkeypatch.setattr(cg, "_systemd_available", lambda: True)
    scope = cg.create_episode_cgroup("ep2", CAPS, root=str(tmp_path / "fs"))
    assert isinstance(scope, cg.SystemdScope) and scope.backend == "systemd"
    monkeypatch.setattr(cg, "_systemd_available", lambda: False)
    with pytest.raises(cg.CgroupError, match=r"cgroup v2: .* does not offer the memory, pids, cpu controller.*Fix: run as root"):
        cg.create_episode_cgroup("ep3", CAPS, root=str(tmp_path / "fs"))


def test_v1_writes_the_caps_in_each_hierarchy_under_the_current_cgroups(monkeypatch, tmp_path):
    fs = tmp_path / "fs"
    for d in ("memory/process_api/abc", "pids", "cpu,cpuacct"):
        (fs / d).mkdir(parents=True)
    (fs / "cpu").symlink_to("cpu,cpuacct")
    (fs / "cpuacct").symlink_to("cpu,cpuacct")
    fake_proc_cgroup(monkeypatch, tmp_path, "4:memory:/process_api/abc\n8:pids:/\n2:cpu,cpuacct:/\n0::/\n")
    group = cg.create_episode_cgroup("ep4", CAPS, root=str(fs))
    assert isinstance(group, cg.V1Cgroup) and group.backend == "cgroup-v1"
    real = fs.resolve()
    assert group.dirs == {"memory": real / "memory/process_api/abc/ep4", "pids": real / "pids/ep4",
                          "cpu": real / "cpu,cpuacct/ep4", "cpuacct": real / "cpu,cpuacct/ep4"}
    assert (group.dirs["memory"] / "memory.limit_in_bytes").read_text() == str(300 << 20)
    assert (group.dirs["pids"] / "pids.max").read_text() == "50"
    assert (group.dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "150000"


def test_the_systemd_scope_command(monkeypatch):
    scope = cg.SystemdScope("ds_ttt_sbx_x", CAPS, Path("/sys/fs/cgroup"), user=True)
    argv = scope.wrap(["bwrap", "--unshare-all", "--", "bash"])
    assert argv == ["systemd-run", "--user", "--scope", "--quiet", "--collect", "--unit=ds_ttt_sbx_x_1",
                    "-p", f"MemoryMax={300 << 20}", "-p", "MemorySwapMax=0", "-p", "TasksMax=50",
                    "-p", "CPUQuota=150%", "--", "bwrap", "--unshare-all", "--", "bash"]
    assert scope.wrap(["bash"])[5] == "--unit=ds_ttt_sbx_x_2"  # a restarted sandbox process gets its own scope
    assert "--user" not in cg.SystemdScope("s", CAPS, Path("/sys/fs/cgroup"), user=False).wrap(["bash"])
