"""Throwaway sandboxes in which the generator and the serve runner run real bash commands.

    with Sandbox(timeout=5.0) as sb:                 # refuses when the isolation below is unavailable
        sb.write("notes.txt", "hello\\n")
        result = sb.run("wc -l notes.txt")            # CommandResult(output, exit_code, timed_out, ...)
    Sandbox(isolation="none")                         # an explicit choice to run without it (--no-isolation)

Layout: a fresh directory BASE (removed on exit unless `keep`) holding `work/` — `sb.root`, the
working directory and HOME of every command — and `tmp/`, the command's TMPDIR.

Every command runs as `bash --noprofile --norc -c CMD` with stdin from /dev/null, a minimal
environment (C locale, fixed PATH, no proxies), in a new session, through `sandbox_init.py`.
`isolation="required"` (the default; `sb.isolation == "unshare"`) adds, per command, fresh user,
network, mount and PID namespaces (`unshare --user --map-root-user --net --mount --pid`):

  - no network: the network namespace has only a downed loopback (not even 127.0.0.1 is reachable);
  - writes land only in BASE: every mount is read-only except BASE, and /tmp and /var/tmp are BASE/tmp,
    so `echo x > ../escape` lands in BASE and `touch /tmp/x` in BASE/tmp; the mounts are locked (the
    command runs in a nested user namespace), so it cannot remount them read-write;
  - at most `max_processes` processes at once (a fork bomb gets EAGAIN);
  - when the command ends, is killed at its timeout, or its output passes the cap, the PID namespace
    ends and the kernel kills everything the command started, detached (setsid, nohup) or not.

Both modes cap what the host reads (`max_output_bytes`; past it the command is killed and the result
marked truncated, so a command printing 1 GB never reaches the host's memory), cap one file's size
(RLIMIT_FSIZE), kill the command's process group at the timeout or the output cap, and kill what is
left of that group when the command ends. `isolation="none"` gives no network, filesystem or process
isolation: commands run as the calling user with its network and its write access everywhere, and a
process that leaves the process group (setsid) survives.

What the sandbox does not protect: reads (the command sees every host file the caller may read and
can print it); the CPU and memory it uses before its timeout; disk space inside BASE (bounded by the
file-size cap, the timeout and the disk); the kernel (user namespaces are no defence against kernel
exploits; character devices in the host's /dev the caller may open stay usable). It is made for the
generator's scripted commands and for trying a model, not for running untrusted code. docs/data.md,
"Sandbox", has the details.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LC_ALL": "C",
    "LANG": "C",
    "TERM": "dumb",
    "TZ": "UTC",
    "SHELL": "/bin/bash",
}
ISOLATION_CHOICES = ("required", "none")
MAX_OUTPUT_BYTES = 1 << 20  # what the host reads of one command's output before killing it
MAX_PROCESSES = 300  # per command; a per-namespace pid_max cannot go below 301 (the kernel's PID_MAX_MIN)
MAX_FILE_BYTES = 1 << 30  # RLIMIT_FSIZE: the largest file a command may write
INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc")
_READ_CHUNK = 1 << 16


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command): isolation unavailable, or its setup failed."""


@dataclass
class CommandResult:
    command: str
    output: str
    exit_code: int
    timed_out: bool = False
    output_truncated: bool = False  # the output passed max_output_bytes: the command was killed there
    output_bytes: int = 0  # bytes of output the host read (at most max_output_bytes + one chunk)


def _unshare_path() -> str | None:
    return shutil.which("unshare")


@functools.lru_cache(maxsize=1)
def isolation_problem() -> str | None:
    """None when `isolation="required"` works here, else why not (probed once per process).

    The probe runs a real command through the isolated path and checks, from the host, that a write to
    the directory above BASE stayed inside BASE, that /tmp is BASE/tmp, and that a TCP connection to a
    port listening on the host's 127.0.0.1 fails.
    """
    unshare = _unshare_path()
    if unshare is None:
        return "`unshare` (util-linux) is not on PATH"
    base = Path(tempfile.mkdtemp(prefix="ds_ttt_sbx_probe_")).resolve()
    outside = base.parent / f"{base.name}.escape"
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        (base / "work").mkdir()
        (base / "tmp").mkdir()
        probe = (f"touch /tmp/probe; touch {outside} 2>/dev/null; "
                 f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo NETWORK_REACHABLE; true")
        try:
            res = _execute("unshare", base, probe, unshare=unshare, timeout=10.0, max_output_bytes=MAX_OUTPUT_BYTES,
                           max_processes=MAX_PROCESSES)
        except SandboxError as e:
            return str(e)
        if res.exit_code != 0:
            return f"the isolated probe command exited {res.exit_code}: {res.output.strip()[:300]}"
        if outside.exists():
            return f"a write from inside the sandbox reached {outside} (the filesystem is not confined)"
        if not (base / "tmp" / "probe").is_file():
            return "/tmp inside the sandbox is not the sandbox's own tmp directory"
        if "NETWORK_REACHABLE" in res.output:
            return "the network is reachable from inside the sandbox (a connection to 127.0.0.1 succeeded)"
        return None
    finally:
        listener.close()
        if outside.exists():
            outside.unlink()
        remove_tree(base)


def network_isolation_available() -> bool:
    """True when the full isolation of `isolation="required"` (network included) works here."""
    return isolation_problem() is None


def isolation_refusal(problem: str) -> str:
    """The error text when isolation is required but unavailable: why, and how to accept running without."""
    return (f"sandbox isolation is unavailable here: {problem}. Without it, commands run with this machine's network, "
            f"write access and process table. To accept that, pass --no-isolation (data_prep/generate.py, the serve "
            f"runner) or Sandbox(isolation='none') / generate(..., isolation='none').")


def resolve_isolation(isolation: str) -> str:
    """The isolation a sandbox will use for the choice `isolation` ("unshare" or "none"); raises
    `SandboxError` (why + how to accept) when "required" cannot be had, `ValueError` on a bad choice."""
    if isolation not in ISOLATION_CHOICES:
        raise ValueError(f"isolation={isolation!r}: choose one of {ISOLATION_CHOICES}")
    if isolation == "none":
        return "none"
    problem = isolation_problem()
    if problem is not None:
        raise SandboxError(isolation_refusal(problem))
    return "unshare"


def remove_tree(path: Path) -> None:
    """rmtree that also removes what a command made unreadable or read-only (chmod 000 dirs)."""
    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=fix)


def _env(base: Path) -> dict[str, str]:
    return dict(SANDBOX_ENV, HOME=str(base / "work"), TMPDIR=str(base / "tmp"))


def _argv(mode: str, base: Path, command: str, max_processes: int, unshare: str | None, error_fd: int) -> list[str]:
    init = [sys.executable, "-S", "-I", str(INIT_SCRIPT), mode, str(base), str(base / "work"), str(max_processes),
            str(MAX_FILE_BYTES), str(error_fd), "--", "bash", "--noprofile", "--norc", "-c", command]
    return [unshare, *UNSHARE_FLAGS, *init] if mode == "unshare" else init


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _execute(mode: str, base: Path, command: str, *, unshare: str | None, timeout: float, max_output_bytes: int,
             max_processes: int) -> CommandResult:
    """Run one command in sandbox BASE (mode "unshare" or "none"), reading at most max_output_bytes."""
    err_r, err_w = os.pipe()  # sandbox_init.py reports setup failures here; the command never inherits it
    try:
        proc = subprocess.Popen(_argv(mode, base, command, max_processes, unshare, err_w), cwd=base / "work", env=_env(base),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=(err_w,))
    finally:
        os.close(err_w)
    out, total = bytearray(), 0
    timed_out = truncated = False
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    try:
        while True:  # read until EOF (every holder of the pipe is gone), the timeout, or the cap
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            out += chunk[: max(0, max_output_bytes - len(out))]
            if total > max_output_bytes:
                truncated = True
                break
        while not (timed_out or truncated):  # EOF, but the process may still run with its output closed
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.005)
    finally:
        # The group leader is still unreaped here, so its pgid cannot have been reused. Killing the group
        # ends anything the command left behind (and, isolated, the whole PID namespace via --kill-child).
        _kill_group(proc.pid)
        proc.stdout.close()
        returncode = proc.wait()
        with os.fdopen(err_r, "rb") as f:
            init_error = f.read().decode("utf-8", "replace")
    if init_error:
        raise SandboxError(f"the sandbox could not be set up (exit {returncode}): {init_error}")
    text = bytes(out).decode("utf-8", "replace")
    if timed_out:
        return CommandResult(command, text, 124, timed_out=True, output_bytes=total)
    return CommandResult(command, text, returncode, output_truncated=truncated, output_bytes=total)


class Sandbox:
    """A throwaway directory plus `run(command)`; a context manager (BASE is removed on exit unless kept).

    isolation: "required" (default) refuses with `SandboxError` when the namespaces are unavailable;
    "none" runs without them. `self.isolation` is what is used ("unshare" or "none"): record it.
    """

    def __init__(self, parent: str | None = None, keep: bool = False, timeout: float = 5.0, *,
                 isolation: str = "required", max_output_bytes: int = MAX_OUTPUT_BYTES,
                 max_processes: int = MAX_PROCESSES):
        if max_processes < MAX_PROCESSES:
            raise ValueError(f"max_processes={max_processes}: the per-namespace pid_max limit cannot go below {MAX_PROCESSES}")
        if max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
        self.isolation = resolve_isolation(isolation)
        self._unshare = _unshare_path() if self.isolation == "unshare" else None
        self.base = Path(tempfile.mkdtemp(prefix="ds_ttt_sbx_", dir=parent)).resolve()
        self.root = self.base / "work"  # the working directory and HOME of every command
        self.root.mkdir()
        (self.base / "tmp").mkdir()
        self.keep = keep
        self.timeout = timeout
        self.max_output_bytes = max_output_bytes
        self.max_processes = max_processes

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        if not self.keep:
            remove_tree(self.base)

    def write(self, rel: str, text: str, mode: int | None = None) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if mode is not None:
            os.chmod(path, mode)

    def run(self, command: str) -> CommandResult:
        return _execute(self.isolation, self.base, command, unshare=self._unshare, timeout=self.timeout,
                        max_output_bytes=self.max_output_bytes, max_processes=self.max_processes)


def format_observation(result: CommandResult, max_chars: int = 2000) -> str:
    """The tool-result text the agent sees: the real output, trimmed of trailing newlines, with the exit
    status appended when non-zero (and a note when the command timed out or the output was cut)."""
    out = result.output.rstrip("\n")
    if result.output_truncated:
        out = out[:max_chars] + f"\n[output truncated: the command was killed after {result.output_bytes} bytes of output]"
        return out
    if len(out) > max_chars:
        out = out[:max_chars] + f"\n[output truncated: {len(result.output)} chars]"
    if result.timed_out:
        out += ("\n" if out else "") + "[command timed out]"
    elif result.exit_code != 0:
        out += ("\n" if out else "") + f"[exit code: {result.exit_code}]"
    return out if out else "(no output)"
