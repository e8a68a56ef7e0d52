"""The sandbox never opens up silently, and holds its limits against hostile but harmless commands.

    .venv/bin/python -m pytest tests/unit/test_sandbox.py -q

Refusal is tested by simulating unavailable isolation (a failing probe, and PATH without `unshare`).
The limits are tested through the serve runner's `BashToolRunner` (the class that runs a model's
commands) and `Sandbox`: 1 GB of output, `sleep 1000` with a detached child, 500 background
processes, and writes outside the working directory. Every command has a short timeout; marker
arguments (`sleep 987.<n>`) let the tests check from the host that no process is left behind.
"""

import json
import os
import resource
import threading
import time
import uuid
from pathlib import Path

import pytest

from ds_ttt.data import sandbox as sandbox_mod
from ds_ttt.data.cli import generate_main
from ds_ttt.data.generator import generate
from ds_ttt.data.sandbox import MAX_OUTPUT_BYTES, MAX_PROCESSES, Sandbox, SandboxError, format_observation
from ds_ttt.serve.runner import BashToolRunner

needs_isolation = pytest.mark.skipif(not sandbox_mod.network_isolation_available(),
                                     reason=f"sandbox isolation unavailable here: {sandbox_mod.isolation_problem()}")


def bash_call(command: str) -> dict:
    return {"function": {"name": "bash", "arguments": json.dumps({"command": command})}}


def processes_with(marker: str, *, sleep_only: bool = False) -> list[int]:
    """PIDs (seen from the host) whose command line contains `marker` (or is exactly `sleep MARKER`)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmdline = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if (cmdline == f"sleep\0{marker}\0".encode()) if sleep_only else (marker.encode() in cmdline):
                pids.append(int(p.name))
    return pids


def wait_gone(marker: str, within: float = 3.0) -> list[int]:
    deadline = time.monotonic() + within
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture()
def no_isolation_here(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "isolation_problem", lambda: "simulated: user namespaces are disabled")


# ---------------------------------------------------------------- refusal
def test_sandbox_refuses_when_isolation_is_unavailable(no_isolation_here, tmp_path):
    with pytest.raises(SandboxError) as e:
        Sandbox(parent=str(tmp_path))
    msg = str(e.value)
    assert "simulated: user namespaces are disabled" in msg  # why
    assert "--no-isolation" in msg and "isolation='none'" in msg  # how to accept it
    assert list(tmp_path.iterdir()) == []  # refused before creating anything
    with Sandbox(parent=str(tmp_path), isolation="none") as sb:  # the explicit choice works
        assert sb.isolation == "none"
        assert sb.run("echo hi").output == "hi\n"


def test_runner_refuses_when_isolation_is_unavailable(no_isolation_here):
    with pytest.raises(SandboxError, match="--no-isolation"):
        BashToolRunner(timeout=1)


def test_generator_refuses_and_records_the_isolation_used(no_isolation_here, tmp_path, capsys):
    with pytest.raises(SandboxError, match="--no-isolation"):
        generate(2, 0, workers=1)
    assert generate_main(["--out", str(tmp_path / "g"), "--num", "2", "--seed", "0", "--workers", "1", "--no-token-stats"]) == 2
    err = capsys.readouterr().err
    assert "simulated: user namespaces are disabled" in err and "--no-isolation" in err
    assert not (tmp_path / "g").exists()
    assert generate_main(["--out", str(tmp_path / "g"), "--num", "2", "--seed", "0", "--workers", "1", "--no-token-stats",
                          "--no-isolation"]) == 0
    trajs = [json.loads(line) for line in (tmp_path / "g" / "trajectories.jsonl").read_text().splitlines()]
    assert [t["meta"]["isolation"] for t in trajs] == ["none", "none"]
    atif = json.loads((tmp_path / "g" / "atif" / f"{trajs[0]['id']}.json").read_text())
    assert atif["extra"]["meta"]["isolation"] == "none"


def test_real_probe_without_unshare_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare here
    sandbox_mod.isolation_problem.cache_clear()
    try:
        assert "`unshare` (util-linux) is not on PATH" in sandbox_mod.isolation_problem()
        with pytest.raises(SandboxError, match="unshare.*not on PATH.*--no-isolation"):
            Sandbox()
    finally:
        monkeypatch.undo()
        sandbox_mod.isolation_problem.cache_clear()


def test_bad_isolation_choice_is_refused():
    with pytest.raises(ValueError, match="isolation='off'.*required.*none"):
        Sandbox(isolation="off")


@needs_isolation
def test_default_isolation_is_recorded():
    with Sandbox() as sb:
        assert sb.isolation == "unshare"
    (t,) = generate(1, 3, workers=1)
    assert t["meta"]["isolation"] == "unshare"


# ---------------------------------------------------------------- limits, through the serve runner
@needs_isolation
def test_a_gigabyte_of_output_is_cut_and_killed():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with BashToolRunner(timeout=20) as runner:
        t0 = time.monotonic()
        obs = runner.execute(bash_call("yes | head -c 1000000000"))
        took = time.monotonic() - t0
        res = runner.sandbox.run("head -c 1000000000 /dev/zero | tr '\\0' x")
    assert took < 5.0, took  # killed at the cap, not after a gigabyte
    assert "[output truncated: the command was killed after" in obs and obs.startswith("y\ny\n")
    assert res.output_truncated and not res.timed_out
    assert MAX_OUTPUT_BYTES < res.output_bytes <= MAX_OUTPUT_BYTES + (1 << 16)
    assert len(res.output) == MAX_OUTPUT_BYTES and set(res.output) == {"x"}  # the head is kept
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, grown_mib


@needs_isolation
def test_sleep_is_killed_at_the_timeout_with_its_detached_children():
    n = uuid.uuid4().int % 10**6
    marker, main = f"987.{n}", f"1000.{n}"
    with BashToolRunner(timeout=1) as runner:
        t0 = time.monotonic()
        obs = runner.execute(bash_call(f"setsid sleep {marker} & nohup sleep {marker} >/dev/null 2>&1 & sleep {main}"))
        took = time.monotonic() - t0
    assert "[command timed out]" in obs
    assert took < 4.0, took
    assert wait_gone(marker) == [] and wait_gone(main) == []


@needs_isolation
def test_background_processes_are_killed_when_the_command_ends():
    marker = f"987.{uuid.uuid4().int % 10**6}"
    with BashToolRunner(timeout=5) as runner:
        assert runner.execute(bash_call(f"(setsid sleep {marker} &) ; sleep {marker} >/dev/null & echo started")) == "started"
    assert wait_gone(marker) == []


@needs_isolation
def test_many_processes_hit_the_process_limit():
    marker = f"987.{uuid.uuid4().int % 10**6}"
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], len(processes_with(marker, sleep_only=True)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with BashToolRunner(timeout=3) as runner:
            # a bounded fork bomb: 500 background sleeps, more than the sandbox's MAX_PROCESSES
            obs = runner.execute(bash_call(f"i=0; while [ $i -lt 500 ]; do sleep {marker} & i=$((i+1)); done; echo all-started"))
    finally:
        stop.set()
        watcher.join()
    assert "Resource temporarily unavailable" in obs and "all-started" not in obs
    assert 100 < peak[0] < MAX_PROCESSES, peak[0]  # the shell is one of the MAX_PROCESSES
    assert wait_gone(marker) == []


@needs_isolation
def test_writes_outside_the_working_directory_fail_or_stay_in_the_throwaway_root():
    token = uuid.uuid4().hex[:12]
    host_tmp = Path("/tmp") / f"escape_{token}"
    host_root = Path("/") / f"escape_{token}"
    try:
        with BashToolRunner(timeout=5) as runner:
            base, root = runner.sandbox.base, runner.root
            above_base = base.parent / f"escape_{token}"
            obs = runner.execute(bash_call(
                f"echo x > ../escape_{token}; touch /tmp/escape_{token} $TMPDIR/tmpdir_{token} /var/tmp/var_{token}; "
                f"echo x > {above_base}; echo x > /escape_{token}; echo x > {Path(__file__).parent}/escape_{token}"))
            assert root.parent == base and (base / f"escape_{token}").read_text() == "x\n"  # ../ is the throwaway root
            assert (base / "tmp" / f"escape_{token}").is_file() and (base / "tmp" / f"tmpdir_{token}").is_file()
            assert (base / "tmp" / f"var_{token}").is_file()
            assert not host_tmp.exists() and not above_base.exists()  # /tmp is the sandbox's own
            assert f"/escape_{token}: Read-only file system" in obs
            assert not host_root.exists() and not (Path(__file__).parent / f"escape_{token}").exists()
        assert not base.exists()
    finally:
        for p in (host_tmp, host_root, Path(__file__).parent / f"escape_{token}"):
            if p.exists():
                p.unlink()


@needs_isolation
def test_the_command_cannot_undo_its_confinement():
    token = uuid.uuid4().hex[:12]
    try:
        with Sandbox(timeout=5) as sb:
            r = sb.run(f"mount -o remount,bind,rw / ; umount /tmp ; umount -l /tmp ; mount -o remount,bind,rw /proc/sys ; "
                       f"echo 100000 > /proc/sys/kernel/pid_max ; cat /proc/sys/kernel/pid_max ; ip link set lo up ; "
                       f"touch /escape_{token} /tmp/inside_{token}")
            assert "mount: /: permission denied" in r.output  # the read-only mounts are locked
            assert "pid_max: Read-only file system" in r.output and f"\n{MAX_PROCESSES + 1}\n" in r.output
            assert "Operation not permitted" in r.output  # no reconfiguring the network namespace
            assert f"/escape_{token}': Read-only file system" in r.output
            assert (sb.base / "tmp" / f"inside_{token}").is_file()  # /tmp is still the sandbox's own
    finally:
        if Path(f"/escape_{token}").exists():
            Path(f"/escape_{token}").unlink()
        assert not Path(f"/tmp/inside_{token}").exists()


@needs_isolation
def test_no_network_even_to_localhost():
    import socket

    with socket.socket() as server, BashToolRunner(timeout=5) as runner:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        obs = runner.execute(bash_call(f"exec 3<>/dev/tcp/127.0.0.1/{port}"))
    assert "Network is unreachable" in obs and "[exit code: 1]" in obs


def test_without_isolation_the_timeout_and_output_cap_still_hold(tmp_path):
    marker = f"987.{uuid.uuid4().int % 10**6}"
    with Sandbox(parent=str(tmp_path), timeout=1, isolation="none") as sb:
        t0 = time.monotonic()
        r = sb.run(f"sleep {marker} & sleep 1000")
        assert r.timed_out and time.monotonic() - t0 < 4.0
        r = sb.run("yes | head -c 1000000000")
        assert r.output_truncated and r.output_bytes <= MAX_OUTPUT_BYTES + (1 << 16)
        assert sb.run("echo x > ../escape && cat ../escape").output == "x\n"  # ../ is still the throwaway root
        assert sb.run("echo $TMPDIR").output.strip() == str(sb.base / "tmp")
    assert wait_gone(marker) == []


def test_format_observation_notes_truncation():
    r = sandbox_mod.CommandResult("c", "a" * 5000, -9, output_truncated=True, output_bytes=1_114_112)
    obs = format_observation(r, max_chars=10)
    assert obs == "a" * 10 + "\n[output truncated: the command was killed after 1114112 bytes of output]"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_processes=10: .* cannot go below 300"):
        Sandbox(max_processes=10, isolation="none")
    assert os.path.isfile(sandbox_mod.INIT_SCRIPT)
