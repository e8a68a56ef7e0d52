"""The sandbox refuses without bubblewrap, and its persistent shell keeps state, frames output and restarts honestly.

    .venv/bin/python -m pytest tests/unit/test_sandbox.py -q

Refusal is tested by simulating an unavailable sandbox (a failing probe, and PATH without `bwrap`).
The shell is tested through `Sandbox.run` (what the generator's `Episode.act` calls) and the serve
runner's `BashToolRunner`: state that carries over, exact exit codes and bytes, timeouts that kill the
command but keep the shell and its files, a busy or exited shell restarted with a note, the output
cap, host writes that a link inside cannot redirect, and `keep=True`. Attacks are in
test_sandbox_hostile.py.
"""

import json
import os
import stat
import time
from pathlib import Path

import pytest

from ds_ttt.data.cli import generate_main
from ds_ttt.data.generator import generate
from ds_ttt.sandbox import CommandResult, Sandbox, SandboxError, format_observation, probe
from ds_ttt.sandbox.files import remove_tree
from ds_ttt.sandbox.shell import MAX_OUTPUT_BYTES
from ds_ttt.serve.tools import BashToolRunner

needs_bwrap = pytest.mark.skipif(not probe.network_isolation_available(),
                                 reason=f"bubblewrap sandbox unavailable here: {probe.isolation_problem()}")


def bash_call(command: str) -> dict:
    return {"function": {"name": "bash", "arguments": json.dumps({"command": command})}}


@pytest.fixture()
def no_bwrap_here(monkeypatch):
    monkeypatch.setattr(probe, "isolation_problem", lambda: "simulated: bwrap cannot create namespaces")


# ---------------------------------------------------------------- refusal
def test_sandbox_refuses_without_bwrap(no_bwrap_here, tmp_path):
    with pytest.raises(SandboxError) as e:
        Sandbox(parent=str(tmp_path))
    msg = str(e.value)
    assert "simulated: bwrap cannot create namespaces" in msg  # why
    assert "apt-get install bubblewrap" in msg  # the fix
    assert "--no-isolation" in msg and "isolation='none'" in msg  # how to accept running without
    assert list(tmp_path.iterdir()) == []  # refused before creating anything
    with Sandbox(parent=str(tmp_path), isolation="none") as sb:  # the explicit choice works
        assert sb.isolation == "none"
        assert sb.run("echo hi").output == "hi\n"


def test_runner_refuses_without_bwrap(no_bwrap_here):
    with pytest.raises(SandboxError, match="apt-get install bubblewrap.*--no-isolation"):
        BashToolRunner(timeout=1)


def test_generator_refuses_and_records_the_isolation_used(no_bwrap_here, tmp_path, capsys):
    with pytest.raises(SandboxError, match="--no-isolation"):
        generate(2, 0, workers=1)
    assert generate_main(["--out", str(tmp_path / "g"), "--num", "2", "--seed", "0", "--workers", "1", "--no-token-stats"]) == 2
    err = capsys.readouterr().err
    assert "simulated: bwrap cannot create namespaces" in err and "apt-get install bubblewrap" in err
    assert not (tmp_path / "g").exists()
    assert generate_main(["--out", str(tmp_path / "g"), "--num", "2", "--seed", "0", "--workers", "1", "--no-token-stats",
                          "--no-isolation"]) == 0
    trajs = [json.loads(line) for line in (tmp_path / "g" / "trajectories.jsonl").read_text().splitlines()]
    assert [t["meta"]["isolation"] for t in trajs] == ["none", "none"]


def test_real_probe_without_bwrap_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    probe.isolation_problem.cache_clear()
    try:
        assert probe.isolation_problem() == "`bwrap` is not on PATH"
        with pytest.raises(SandboxError, match="bwrap.*not on PATH.*apt-get install bubblewrap.*--no-isolation"):
            Sandbox()
    finally:
        monkeypatch.undo()
        probe.isolation_problem.cache_clear()


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match="isolation='off'.*required.*none"):
        Sandbox(isolation="off")
    with pytest.raises(ValueError, match="absolute"):
        Sandbox(isolation="none", workdir="app")


@needs_bwrap
def test_default_isolation_is_recorded():
    with Sandbox() as sb:
        assert sb.isolation == "bwrap"
    (t,) = generate(1, 3, workers=1)
    assert t["meta"]["isolation"] == "bwrap"


# ---------------------------------------------------------------- the persistent shell
@pytest.mark.parametrize("isolation", ["required", "none"])
def test_state_carries_over_and_output_is_exact(isolation):
    if isolation == "required" and not probe.network_isolation_available():
        pytest.skip(f"bubblewrap sandbox unavailable here: {probe.isolation_problem()}")
    with Sandbox(timeout=5, isolation=isolation) as sb:
        sb.write("sub/notes.txt", "a\nb\n")
        assert sb.run("echo ${OLDPWD-unset}").output == "unset\n"  # the driver's own cd left no trace
        assert sb.run("cd sub && export N=3 && f() { echo \"f:$1\"; }").exit_code == 0
        assert sb.run("wc -l < notes.txt; echo $N; f x").output == "2\n3\nf:x\n"  # cwd, variable, function
        assert sb.run("sleep 30 & echo started").output == "started\n"
        assert "Running" in sb.run("jobs").output  # the job outlives its command
        r = sb.run("printf 'no newline'; exit_code() { return $1; }; exit_code 42")
        assert (r.output, r.exit_code) == ("no newline", 42)  # exact bytes and exit code
        r = sb.run("echo 0 >&3; echo 0 >&4; printf '0\\n'; false")  # the status pipe is out of reach
        assert r.exit_code == 1 and r.output.count("Bad file descriptor") == 2 and r.output.endswith("0\n")
        assert sb.run("printf '\\xff\\x00x'").raw == b"\xff\x00x"
        assert sb.run("cat").output == ""  # stdin is /dev/null: nothing waits for input
        assert sb.run("catt").output == "bash: line 1: catt: command not found\n"  # as `bash -c` words it


@needs_bwrap
def test_timeout_kills_the_command_and_keeps_the_shell():
    with Sandbox(timeout=1) as sb:
        sb.run("cd /tmp && export KEEP=yes && echo data > f")
        t0 = time.monotonic()
        r = sb.run("sleep 100 | cat; echo never")
        assert r.timed_out and r.exit_code == 124 and not r.shell_restarted and time.monotonic() - t0 < 4
        assert "never" not in r.output
        assert sb.run("echo $PWD $KEEP; cat f").output == "/tmp yes\ndata\n"  # same shell, same files
        assert "sleep 100" not in sb.run("ps -e -o args").output  # the command's processes are gone


@needs_bwrap
def test_a_busy_or_exited_shell_is_stopped_or_restarted_with_its_files():
    with Sandbox(timeout=1) as sb:
        sb.run("cd /tmp && export KEEP=yes && echo data > /app/f")
        r = sb.run("while :; do :; done; echo never")  # the shell itself is busy: the trap abandons the line
        assert r.timed_out and not r.shell_restarted and r.output == ""
        assert sb.run("echo $PWD $KEEP").output == "/tmp yes\n"
        r = sb.run("trap '' USR1; while :; do :; done")  # deaf to the trap: the shell is killed and replaced
        assert r.timed_out and r.shell_restarted and not r.files_lost
        obs = format_observation(r)
        assert "[command timed out]" in obs and "[the shell was restarted: files are kept" in obs
        assert sb.run("echo \"$PWD:$KEEP\"; cat /app/f").output == "/app:\ndata\n"
        r = sb.run("exit 7")
        assert r.exit_code == 7 and r.shell_restarted and "[exit code: 7]" in format_observation(r)
        assert sb.run("cat f").output == "data\n"


@needs_bwrap
def test_runner_keeps_one_shell_and_cuts_output():
    with BashToolRunner(timeout=10) as runner:
        assert runner.execute(bash_call("mkdir -p w && cd w && export V=1")) == "(no output)"
        assert runner.execute(bash_call("pwd; echo $V")) == "/app/w\n1"
        t0 = time.monotonic()
        obs = runner.execute(bash_call("yes | head -c 1000000000"))
        assert time.monotonic() - t0 < 5 and "[output truncated: the command was killed after" in obs
        res = runner.sandbox.run("head -c 100000000 /dev/zero | tr '\\0' x")
        assert res.output_truncated and len(res.output) == MAX_OUTPUT_BYTES and set(res.output) == {"x"}
        assert runner.execute(bash_call("pwd")) == "/app/w"  # the cut killed the command, not the shell


@needs_bwrap
def test_host_writes_cannot_be_redirected_by_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("host file\n")
    os.chmod(tmp_path, 0o777)
    with Sandbox(timeout=5) as sb:
        sb.run(f"ln -s {victim} /app/link")
        with pytest.raises(SandboxError, match="No such file or directory|Read-only"):
            sb.write("link", "overwritten\n")  # resolved inside: the host path does not exist there
        assert victim.read_text() == "host file\n"
        with pytest.raises(SandboxError):
            sb.read("/app/link")


@needs_bwrap
def test_keep_exports_the_writable_directories(tmp_path):
    parent = Path(tempfile_dir())
    with Sandbox(parent=str(parent), keep=True) as sb:
        sb.write("a.txt", "A\n")
        sb.run("mkdir d && echo B > d/b.txt && ln -s /etc/passwd d/l && echo T > /tmp/t")
        root = sb.root
    assert (root / "a.txt").read_text() == "A\n" and (root / "d" / "b.txt").read_text() == "B\n"
    assert os.readlink(root / "d" / "l") == "/etc/passwd"  # kept as a link, never followed
    assert (sb.fs_root / "tmp" / "t").read_text() == "T\n"
    remove_tree(parent)


def tempfile_dir() -> str:
    import tempfile

    d = tempfile.mkdtemp(prefix="ds_ttt_keep_")
    os.chmod(d, 0o711)  # a root caller's sandbox runs as uid 65534, which must reach it
    return d


def test_without_isolation_the_timeout_and_output_cap_still_hold(tmp_path):
    with Sandbox(parent=str(tmp_path), timeout=1, isolation="none") as sb:
        t0 = time.monotonic()
        r = sb.run("sleep 1000")
        assert r.timed_out and time.monotonic() - t0 < 4.0
        r = sb.run("yes | head -c 1000000000")
        assert r.output_truncated and r.output_bytes <= MAX_OUTPUT_BYTES + 1
        assert sb.run("pwd").output.strip() == str(sb.root)  # /app is a host directory here


def test_format_observation_notes():
    r = CommandResult("c", "a" * 5000, -9, output_truncated=True, output_bytes=1_114_112)
    assert format_observation(r, max_chars=10) == "a" * 10 + "\n[output truncated: the command was killed after 1114112 bytes of output]"
    r = CommandResult("c", "x\n", 3, shell_restarted=True)
    assert format_observation(r) == ("x\n[exit code: 3]\n[the shell was restarted: files are kept; the working directory, "
                                     "variables and background jobs are reset]")
    assert format_observation(CommandResult("c", "", 0)) == "(no output)"


def test_remove_tree_changes_no_mode_outside_the_tree(tmp_path):
    """A missing tree once made remove_tree chmod its parent to 0700 (the shared /tmp, on a second close)."""
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    remove_tree(parent / "gone")  # already removed: nothing to do
    tree = parent / "tree"
    (tree / "locked" / "deep").mkdir(parents=True)
    (tree / "locked" / "deep" / "f").write_text("x")
    os.chmod(tree / "locked" / "deep", 0)
    os.chmod(tree / "locked", 0)
    remove_tree(tree)  # what a command made unreadable still goes
    assert not tree.exists()
    assert stat.S_IMODE(os.stat(parent).st_mode) == 0o1777
