"""The one sandbox in which model-written and scripted bash commands run: bubblewrap plus a persistent shell.

    with Sandbox(timeout=5.0) as sb:                  # refuses (SandboxError) without a working `bwrap`
        sb.write("notes.txt", "hello\\n")            # lands in /app/notes.txt inside
        sb.run("cd sub 2>/dev/null; export N=3")       # one bash per episode: cd, variables, jobs carry over
        result = sb.run("wc -l notes.txt; echo $N")    # CommandResult(output, exit_code, timed_out, ...)
    Sandbox(isolation="none")                          # an explicit choice to run without it (--no-isolation)

Used by the trajectory generator (`generator.py`), the serve runner (`ds_ttt/serve/runner.py`) and the
Harbor environment (`ds_ttt/serve/harbor_env.py`). docs/sandbox.md says what it protects against and
what it does not; tests/unit/test_sandbox_hostile.py (and tests/harbor/ for Harbor) is the attack suite
behind those claims.

What `bwrap` (bubblewrap) builds:

  bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL
        --as-pid-1 --uid 1000 --gid 1000 --ro-bind /usr /usr (+ /bin /lib /lib64 /sbin as on the host)
        --ro-bind /etc /etc (/etc/passwd, /etc/group: the sandbox's own) --proc /proc --dev /dev
        --tmpfs /dev/shm --tmpfs /run --tmpfs WORKDIR --tmpfs /tmp --tmpfs /var/tmp [--tmpfs HOME, dirs]
        --remount-ro / -- bash SUPERVISOR

No network (a fresh network namespace with only its own loopback; abstract Unix sockets belong to it
too), an unprivileged uid 1000 without capabilities or further user namespaces, NO_NEW_PRIVS (setuid
bits do nothing), a private PID namespace (no host process is visible), and no host path except the
read-only system directories: host homes, the project checkout, host sockets and other sandboxes do
not exist inside. The writable places are size-capped tmpfs mounts private to the sandbox (the
working directory `/app` by default, HOME = the working directory unless given, /tmp, /var/tmp,
/dev/shm, /run, and `dirs`); everything else is read-only. So "disk" is memory, bounded by the
mounts' sizes. When the caller is root, bwrap itself runs as uid 65534, because the kernel never
enforces the process limit for the host's root.

The host reaches the files only through the sandbox (`write`, `put`, `put_tree`, `read`, `get_tree`:
cat/tar run inside, so a link made by a command cannot redirect a host read or write); `keep=True`
exports the writable directories into BASE/root on close (`sb.root` is then the working directory's copy).

The persistent shell. bash runs as PID 1 of the sandbox (the SUPERVISOR: PID 1 ignores every signal
sent from inside, so no command can end the sandbox) and starts the DRIVER, the episode's shell. The
host sends each command NUL-terminated on the shell's stdin; the shell `eval`s it in itself (stdin
/dev/null, stderr merged into stdout), then writes `$?` to a separate status pipe. So `cd`, `export`,
functions and background jobs carry over, the output is exactly the command's bytes, and the exit
code is exact. At the timeout or the output cap every process the command started is killed (the
host walks the sandbox's process tree, sparing the shell and jobs of earlier commands) and the shell
lives on. If the shell itself is what runs (a builtin loop), or it exited (`exit 3`: exit code 3), the
supervisor starts a new shell in the same sandbox: the files stay, the working directory, variables
and jobs do not, and the observation says so.

Limits: at most `max_processes` processes (RLIMIT_NPROC, counted in the sandbox's own user
namespace), `max_memory_bytes` of address space per process (RLIMIT_AS), `max_file_bytes` per file
(RLIMIT_FSIZE), `max_cpu_seconds` of CPU per process (RLIMIT_CPU), no core files, `max_output_bytes`
of output read per command (past it the command is killed, the result marked truncated), and the
tmpfs sizes (`max_disk_bytes` for the working directory, `max_scratch_bytes` for each other writable
directory). `isolation="none"` keeps the persistent shell, the output cap, the timeouts and the
per-process rlimits but not the process limit, and nothing else: commands run as the caller, in a
host directory BASE/root (/app is BASE/root/app), with the host's files, network and process table.

The whole episode (every process of the sandbox, whatever it forks) is also a cgroup of its own
(`cgroup_caps.py`: v2, v1 or a systemd scope), made with the sandbox and removed at close: at most
`max_episode_memory_bytes` of memory (tmpfs files included, no swap beyond it), `max_episode_processes`
tasks and `max_episode_cpus` cores of CPU time. When the kernel kills a process at the memory cap
during a command, the command is stopped as at a timeout and the result says so (`memory_limit_hit`,
exit code 137). The host sees the kill by polling the cgroup's OOM count every OOM_POLL_SEC, so a
command line that goes on for less than that after the kill (`hog; echo done`) may finish first: the
result then keeps the line's own exit code and output, and still says that one of its processes was
killed at the cap.
Where no cgroup can be made the sandbox refuses; `cgroup_caps="none"` is the explicit opt-out, and
`self.cgroup_caps` records what was used (both isolations get the cgroup).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import io
import os
import select
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .cgroup_caps import CgroupCaps, CgroupError, EpisodeCgroup, create_episode_cgroup

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LC_ALL": "C",
    "LANG": "C",
    "TERM": "dumb",
    "TZ": "UTC",
    "SHELL": "/bin/bash",
}
ISOLATION_CHOICES = ("required", "none")
CGROUP_CAPS_CHOICES = ("required", "none")  # "none": no per-episode cgroup (--no-cgroup-caps), recorded
INSTALL_HINT = "apt-get install bubblewrap (setup.sh does this)"
WORKDIR = "/app"
SANDBOX_UID = 1000  # the uid inside; it has no capabilities
HOST_UID_FOR_ROOT = 65534  # bwrap runs as this uid when the caller is root (the kernel exempts root from RLIMIT_NPROC)
MAX_OUTPUT_BYTES = 1 << 20  # what the host reads of one command's output before killing it
MAX_PROCESSES = 256  # RLIMIT_NPROC inside (threads count)
BOMB_FRACTION = 0.25  # leftover processes at or above this share of MAX_PROCESSES are killed as a fork bomb
LIMIT_RECHECK_SEC = 0.02  # a background bomb below the limit when its command ends is there this much later
KILL_ROUNDS_SEC = 3.0  # how long a command's leftover processes are stopped and killed, round after round
MAX_FILE_BYTES = 256 << 20  # RLIMIT_FSIZE: the largest file a command may write
MAX_MEMORY_BYTES = 4 << 30  # RLIMIT_AS per process
MAX_CPU_SECONDS = 600  # RLIMIT_CPU per process
MAX_DISK_BYTES = 1 << 30  # the working directory's tmpfs
MAX_SCRATCH_BYTES = 256 << 20  # each other writable tmpfs (/tmp, /var/tmp, HOME, dirs)
SYSTEM_TMPFS_BYTES = 64 << 20  # /dev/shm and /run
# The episode's cgroup (ds_ttt/data/cgroup_caps.py), sized for a 2-core 24 GiB machine running a few at once
EPISODE_MEMORY_BYTES = 4 << 30  # RAM of the whole tree, tmpfs files included; no swap beyond it
EPISODE_PROCESSES = MAX_PROCESSES + 16  # pids.max: RLIMIT_NPROC stops a bomb first; this also holds without it
EPISODE_CPUS = 1.0  # CPU time per wall second, all its processes together: one of the two cores
MEMORY_HEADROOM_BYTES = 64 << 20  # the memory cap must exceed the full tmpfs mounts by this (a shell must still run)
OOM_POLL_SEC = 0.05  # while a command runs, how often the host looks for an OOM kill in the cgroup
MAX_TRANSFER_BYTES = 1 << 30  # read() / get_tree()
SYSTEM_DIRS = ("usr", "etc")  # bound read-only
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr links, or read-only binds
KILL_GRACE_SEC = 2.0  # after a kill, how long the shell has to report
_READ_CHUNK = 1 << 16

# PID 1: moves the status / stderr pipes to fds 3 / 4, then runs the episode's shell, again each time it ends.
SUPERVISOR = ('exec 3>&{st} 4>&{err} {st}>&- {err}>&- 5>&2 2>/dev/null; '  # its own messages ("Killed ...") go nowhere
              'while :; do bash --noprofile --norc -c "$1" bash 2>&5 5>&-; builtin printf \'exit %d\\n\' "$?" >&3; done')
RUN_FUNCTION = '__ds_run() { builtin eval "$__ds_cmd"; }\n'
# The episode's shell.
# Requests arrive NUL-terminated on stdin: a kind ("shell": eval here; "fresh": in a subshell, stderr on
# fd 4) and a command. The status goes to fd 3; a command never holds fds 3, 4 or the request pipe.
DRIVER = ("{limits}; builtin printf 'ready %d\\n' $$ >&3; "
          # at a timeout the host sends SIGUSR1 before killing the command's processes: the trap returns
          # from __ds_run, so the rest of the command line is abandoned (as Ctrl-C would in a terminal)
          "trap 'builtin return 130 2>/dev/null' USR1; "
          # __ds_run comes from a file named `bash` (RUN_FUNCTION), so errors read `bash: x: command not found`
          # as in an interactive terminal (a function defined here would be reported as `environment: line 1`)
          "__o=$PWD; builtin cd {xfer} && shopt -u sourcepath && builtin source bash && shopt -s sourcepath; "
          "builtin cd \"$__o\"; unset OLDPWD __o; "
          "while builtin read -r -d '' __ds_kind && builtin read -r -d '' __ds_cmd; do "
          "if [ \"$__ds_kind\" = shell ]; then { __ds_run; } </dev/null 2>&1 3>&- 4>&-; "
          # "reap" (no command): after the host killed jobs of an earlier command, bash's own notices of
          # their deaths ("Killed  sleep 30") are written here, to /dev/null, not into the next command
          # (its answer is "reaped 0", never a command's status: a late one is skipped, not misread)
          "elif [ \"$__ds_kind\" = reap ]; then { builtin jobs; } >/dev/null 2>&1; "
          "builtin printf 'reaped 0\\n' >&3; continue; "
          "else ( builtin eval \"$__ds_cmd\" ) </dev/null 2>&4 3>&- 4>&-; fi; "
          "builtin printf '%d\\n' \"$?\" >&3; done")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command): bwrap missing or broken, or its setup failed."""


@dataclass
class CommandResult:
    command: str
    output: str
    exit_code: int
    timed_out: bool = False
    output_truncated: bool = False  # the output passed max_output_bytes: the command was killed there
    output_bytes: int = 0  # bytes of output the host read (at most max_output_bytes + one chunk)
    shell_restarted: bool = False  # the shell exited or had to be killed: a new one started in the same sandbox
    files_lost: bool = False  # the whole sandbox had to be restarted: its files are gone
    stderr: str = ""  # only for run_fresh (Harbor's exec); run() merges stderr into output
    raw: bytes = b""  # the output's bytes (for binary transfers)
    process_limit_hit: bool = False  # the command left the sandbox at its process limit: its processes were killed
    memory_limit_hit: bool = False  # the kernel killed a process at the episode's memory cap during the command: the command was stopped (exit code 137), unless its line finished before the host saw the kill
    memory_limit_earlier: bool = False  # ... since the previous command (a background job was killed there)
    memory_limit_bytes: int = 0  # the episode's memory cap (for the note), 0 without a cgroup


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _refuse_text(problem: str) -> str:
    return (f"the sandbox is unavailable here: {problem}. Install bubblewrap ({INSTALL_HINT}). To run commands "
            f"without it, with this machine's network, files and process table, pass --no-isolation "
            f"(data_prep/generate.py, the serve runner) or Sandbox(isolation='none') / generate(..., isolation='none').")


@functools.lru_cache(maxsize=1)
def isolation_problem() -> str | None:
    """None when bubblewrap sandboxes work here, else why not (probed once per process).

    The probe starts a real sandbox and checks that / is read-only inside, the working directory
    writable, the uid SANDBOX_UID, and a TCP port listening on the host's 127.0.0.1 unreachable."""
    if bwrap_path() is None:
        return "`bwrap` is not on PATH"
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        try:
            with Sandbox(timeout=10.0, _probe=True) as sb:
                res = sb.run(f"touch /app/probe; touch /probe; id -u; "
                             f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo REACHABLE; true")
                if res.exit_code != 0:
                    return f"the probe command exited {res.exit_code}: {res.output.strip()[:300]}"
                if "/probe': Read-only file system" not in res.output:
                    return f"/ is writable inside the sandbox: {res.output.strip()[:300]}"
                if f"\n{SANDBOX_UID}\n" not in res.output:
                    return f"the uid inside the sandbox is not {SANDBOX_UID}: {res.output.strip()[:300]}"
                if "REACHABLE" in res.output:
                    return "the host's 127.0.0.1 is reachable from inside the sandbox"
                if sb.read("/app/probe") != b"":
                    return "a file written inside the sandbox cannot be read back"
        except SandboxError as e:
            return str(e)
        return None
    finally:
        listener.close()


def network_isolation_available() -> bool:
    """True when bubblewrap sandboxes (network isolation included) work here."""
    return isolation_problem() is None


def isolation_refusal(problem: str) -> str:
    return _refuse_text(problem)


def resolve_isolation(isolation: str) -> str:
    """What a sandbox will use for the choice `isolation`: "bwrap" or "none". Raises `SandboxError`
    (why, the install command, --no-isolation) when "required" cannot be had, ValueError on a bad choice."""
    if isolation not in ISOLATION_CHOICES:
        raise ValueError(f"isolation={isolation!r}: choose one of {ISOLATION_CHOICES}")
    if isolation == "none":
        return "none"
    problem = isolation_problem()
    if problem is not None:
        raise SandboxError(_refuse_text(problem))
    return "bwrap"


def cgroup_refusal(problem: str) -> str:
    return f"the sandbox cannot cap the episode's memory, processes and CPU here: {problem}"


@functools.lru_cache(maxsize=1)
def cgroup_problem() -> str | None:
    """None when a per-episode cgroup can be made here, else why not and the fix (probed once per process)."""
    try:
        group = create_episode_cgroup(f"ds_ttt_probe_{os.getpid()}_{time.monotonic_ns()}",
                                      CgroupCaps(memory_bytes=64 << 20, processes=16, cpus=1.0))
        group.remove()
    except CgroupError as e:
        return str(e)
    return None


def resolve_cgroup_caps(cgroup_caps: str) -> None:
    """Refuse (SandboxError: why and the fix, --no-cgroup-caps among them) before any sandbox is made when
    "required" caps cannot be had here; ValueError on a bad choice."""
    if cgroup_caps not in CGROUP_CAPS_CHOICES:
        raise ValueError(f"cgroup_caps={cgroup_caps!r}: choose one of {CGROUP_CAPS_CHOICES}")
    if cgroup_caps == "required" and (problem := cgroup_problem()) is not None:
        raise SandboxError(cgroup_refusal(problem))


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


def _tree(root_pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of root_pid's descendants, read from /proc/PID/task/*/children."""
    out, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for k in kids:
                out.append((k, _start_time(k)))
                stack.append(k)
    return out


def _start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def _inner_pid(pid: int) -> int | None:
    """The PID that host process `pid` has in its innermost PID namespace (NSpid's last entry)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def _kill(procs, sig: int = signal.SIGKILL) -> None:
    for pid, _start in procs:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Sandbox:
    """One episode's sandbox: bwrap, one persistent bash, `run(command)`.

    isolation: "required" (default) refuses with `SandboxError` when bwrap does not work here; "none"
    runs the same shell without it. `self.isolation` is what is used ("bwrap" or "none"): record it.
    cgroup_caps: "required" (default) puts the whole episode in a cgroup of its own (memory with no swap
    beyond it, processes, CPU: `max_episode_*`) and refuses with `SandboxError` where none can be made;
    "none" runs without. `self.cgroup_caps` is what is used ("cgroup-v2", "cgroup-v1", "systemd" or
    "none"): record it too.
    A context manager: `close()` kills every process of the sandbox, removes its cgroup, and removes
    BASE unless `keep`.
    """

    def __init__(self, parent: str | None = None, keep: bool = False, timeout: float = 5.0, *,
                 isolation: str = "required", workdir: str = WORKDIR, home: str | None = None,
                 env: dict[str, str] | None = None, dirs: tuple[str, ...] = (),
                 max_output_bytes: int = MAX_OUTPUT_BYTES, max_processes: int = MAX_PROCESSES,
                 max_memory_bytes: int = MAX_MEMORY_BYTES, max_file_bytes: int = MAX_FILE_BYTES,
                 max_cpu_seconds: int = MAX_CPU_SECONDS, max_disk_bytes: int = MAX_DISK_BYTES,
                 max_scratch_bytes: int = MAX_SCRATCH_BYTES, cgroup_caps: str = "required",
                 max_episode_memory_bytes: int = EPISODE_MEMORY_BYTES, max_episode_processes: int = EPISODE_PROCESSES,
                 max_episode_cpus: float = EPISODE_CPUS, _probe: bool = False):
        if max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
        if cgroup_caps not in CGROUP_CAPS_CHOICES:
            raise ValueError(f"cgroup_caps={cgroup_caps!r}: choose one of {CGROUP_CAPS_CHOICES}")
        for path in (workdir, home or "/", *dirs):
            if not PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
                raise ValueError(f"sandbox paths must be absolute, without '..': got {path!r}")
        self.isolation = "bwrap" if _probe else resolve_isolation(isolation)
        self._bwrap = bwrap_path()
        if self.isolation == "bwrap" and self._bwrap is None:
            raise SandboxError(_refuse_text("`bwrap` is not on PATH"))
        self._as_uid = HOST_UID_FOR_ROOT if (os.geteuid() == 0 and self.isolation == "bwrap") else None
        self.base = Path(tempfile.mkdtemp(prefix="ds_ttt_sbx_", dir=parent)).resolve()
        os.chmod(self.base, 0o711)  # bwrap (maybe as HOST_UID_FOR_ROOT) reads passwd/group/xfer; nobody lists BASE
        if self._as_uid is not None:
            _check_reachable(self.base)
        self.keep, self.timeout = keep, timeout
        self.max_output_bytes, self.max_processes = max_output_bytes, max_processes
        self.max_memory_bytes, self.max_file_bytes, self.max_cpu_seconds = max_memory_bytes, max_file_bytes, max_cpu_seconds
        self.workdir, self.home = workdir, home or workdir
        self.mounts: dict[str, int] = {workdir: max_disk_bytes}  # writable tmpfs mounts -> size
        for d in (self.home, "/tmp", "/var/tmp", *dirs):
            if not any(d == m or d.startswith(m.rstrip("/") + "/") for m in self.mounts):
                self.mounts[d] = max_scratch_bytes
        self.caps = CgroupCaps(memory_bytes=max_episode_memory_bytes, processes=max_episode_processes,
                               cpus=max_episode_cpus)
        self._cgroup: EpisodeCgroup | None = None
        self.cgroup_caps = "none"  # what is used: "cgroup-v2", "cgroup-v1", "systemd" or "none"
        self.fs_root = self.base / "root"  # "none": the live `/`; "bwrap": where keep=True exports the mounts
        self.root = self._host(workdir)  # the working directory on the host (live for "none", kept copy for "bwrap")
        if self.isolation == "none":
            for m in self.mounts:
                self._host(m).mkdir(parents=True, exist_ok=True)
            for d in ("/tmp", "/var/tmp"):
                os.chmod(self._host(d), 0o1777)
        self.env = dict(SANDBOX_ENV, HOME=self._inside(self.home), TMPDIR=self._inside("/tmp"), **(env or {}))
        (self.base / "xfer").mkdir(mode=0o755)  # uploads, bound read-only at /run/ds_ttt inside
        (self.base / "xfer" / "bash").write_text(RUN_FUNCTION)
        os.chmod(self.base / "xfer" / "bash", 0o644)
        (self.base / "passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                          f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:{self.home}:/bin/bash\n"
                                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (self.base / "group").write_text(f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
        self._proc: subprocess.Popen | None = None
        self._seed = tarfile.open(fileobj=io.BytesIO(), mode="w")  # files written before the shell starts
        self._num_seeded = 0
        self._num_xfer = 0
        self._supervisor = self._driver = None  # (host pid, start time)
        self._pending_note = (False, False)  # (shell restarted, files lost) to report with the next result
        self.num_restarts = 0
        self._oom_seen = 0  # the cgroup's OOM-kill count when the last result was made
        if cgroup_caps == "required" and not _probe:
            self._make_cgroup()

    def _make_cgroup(self) -> None:
        """The episode's cgroup (caps in `self.caps`), made now so that a machine without cgroups refuses
        before the first command. Files in the tmpfs mounts are memory charged to it, so the memory cap
        must hold them all with room to spare: otherwise a full disk would leave no memory for a shell."""
        tmpfs = sum(self.mounts.values()) + 2 * SYSTEM_TMPFS_BYTES
        try:
            self.caps.validate()
            if self.caps.memory_bytes < tmpfs + MEMORY_HEADROOM_BYTES:
                raise ValueError(
                    f"max_episode_memory_bytes={self.caps.memory_bytes} ({self.caps.memory_bytes >> 20} MiB) cannot hold the "
                    f"sandbox's tmpfs mounts ({tmpfs >> 20} MiB: max_disk_bytes, max_scratch_bytes for each of "
                    f"{len(self.mounts) - 1} more, 2 x {SYSTEM_TMPFS_BYTES >> 20} MiB for /dev/shm and /run) plus "
                    f"{MEMORY_HEADROOM_BYTES >> 20} MiB; files there are memory charged to the episode. Raise it to at "
                    f"least {tmpfs + MEMORY_HEADROOM_BYTES} or lower max_disk_bytes / max_scratch_bytes")
            self._cgroup = create_episode_cgroup(f"{self.base.name}_{os.getpid()}", self.caps)
        except CgroupError as e:
            remove_tree(self.base)
            raise SandboxError(cgroup_refusal(str(e))) from e
        except ValueError:
            remove_tree(self.base)
            raise
        self.cgroup_caps = self._cgroup.backend
        self._oom_seen = self._cgroup.oom_kills()

    def _oom_kills(self) -> int:
        return self._cgroup.oom_kills() if self._cgroup is not None else 0

    def _inside_xfer(self) -> str:
        return "/run/ds_ttt" if self.isolation == "bwrap" else str(self.base / "xfer")

    def _host(self, inside: str) -> Path:
        return self.fs_root / PurePosixPath(inside).relative_to("/")

    def _inside(self, path: str) -> str:
        """A path inside the sandbox as the shell sees it ("none": under BASE/root on the host)."""
        return path if self.isolation == "bwrap" else str(self._host(path))

    # ---- the process -----------------------------------------------------------------------------
    def _argv(self, st_fd: int, err_fd: int) -> list[str]:
        limits = f"ulimit -c 0 -t {self.max_cpu_seconds} -f {self.max_file_bytes // 1024} -v {self.max_memory_bytes // 1024}"
        if self.isolation == "bwrap":
            limits += f" -u {self.max_processes}"
        shell = ["bash", "--noprofile", "--norc", "-c", SUPERVISOR.replace("{st}", str(st_fd)).replace("{err}", str(err_fd)), "bash",
                 DRIVER.replace("{limits}", limits).replace("{xfer}", shlex.quote(self._inside_xfer()))]
        if self.isolation == "none":
            return shell
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--as-pid-1", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--hostname", "sandbox"]
        for name in SYSTEM_DIRS:
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
        for name in SYSTEM_LINKS:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--ro-bind", str(self.base / "passwd"), "/etc/passwd", "--ro-bind", str(self.base / "group"), "/etc/group",
                 "--proc", "/proc", "--dev", "/dev", "--size", str(SYSTEM_TMPFS_BYTES), "--tmpfs", "/dev/shm",
                 "--size", str(SYSTEM_TMPFS_BYTES), "--tmpfs", "/run", "--ro-bind", str(self.base / "xfer"), "/run/ds_ttt"]
        for path, size in sorted(self.mounts.items(), key=lambda kv: len(PurePosixPath(kv[0]).parts)):
            argv += (["--perms", "1777"] if path in ("/tmp", "/var/tmp") else []) + ["--size", str(size), "--tmpfs", path]
        return argv + ["--remount-ro", "/", "--chdir", self.workdir, "--", *shell]

    def _start(self) -> None:
        """Start the sandbox, wait for the shell's `ready`, then copy in the files written so far."""
        pipes = [os.pipe() for _ in range(4)]  # requests, status, output, fresh stderr
        (req_r, req_w), (st_r, st_w), (out_r, out_w), (err_r, err_w) = pipes
        # the status and stderr pipes reach the supervisor as fds >= 10; it moves them to 3 and 4
        st_child, err_child = fcntl.fcntl(st_w, fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(err_w, fcntl.F_DUPFD_CLOEXEC, 10)
        argv = self._argv(st_child, err_child)
        if self._cgroup is not None:
            argv = self._cgroup.wrap(argv)  # systemd: the process starts inside a new scope
        user = {} if self._as_uid is None else {"user": self._as_uid, "group": self._as_uid, "extra_groups": []}
        try:
            self._proc = subprocess.Popen(argv, stdin=req_r, stdout=out_w, stderr=out_w, env=self.env,
                                          cwd="/" if self.isolation == "bwrap" else self.root, start_new_session=True,
                                          pass_fds=(st_child, err_child), **user)
        except OSError as e:
            raise SandboxError(f"could not start the sandbox ({argv[0]}): {e}") from e
        finally:
            for fd in (req_r, st_w, out_w, err_w, st_child, err_child):
                os.close(fd)
        for fd in (st_r, out_r, err_r):
            os.set_blocking(fd, False)
        self._requests, self._status, self._out, self._err = req_w, st_r, out_r, err_r
        self._status_buf = b""
        kind, _value = self._next_status(time.monotonic() + 30.0)
        if kind != "ready":
            out = bytearray()
            self._drain(self._out, out, 1 << 16)
            self._stop()
            raise SandboxError(f"the sandbox did not start: {bytes(out).decode(errors='replace').strip()[:2000]}")
        kids = _tree(self._proc.pid)
        if self._cgroup is not None:
            # Every process of the sandbox so far (bwrap, its PID 1, the shell) joins the episode's cgroup
            # now: none has read a command yet, and whatever they start later is born inside it.
            try:
                self._cgroup.adopt([self._proc.pid] + [pid for pid, _start in kids])
            except OSError as e:
                self._stop()
                raise SandboxError(cgroup_refusal(f"moving the sandbox into its cgroup failed: {e}")) from e
        self._supervisor = (self._proc.pid, _start_time(self._proc.pid)) if self.isolation == "none" else kids[0]
        if self._num_seeded:
            self._seed.close()
            data = self._seed.fileobj.getvalue()
            self._seed = tarfile.open(fileobj=io.BytesIO(), mode="w")
            self._num_seeded = 0
            res = self.put_tree(data, self.workdir)
            if res.exit_code != 0:
                raise SandboxError(f"copying the episode's files into the sandbox failed: {res.stderr.strip()[:2000]}")

    def _find_driver(self, inner_pid: int) -> None:
        for pid, start in _tree(self._proc.pid):
            if _inner_pid(pid) == inner_pid:
                self._driver = (pid, start)
                return
        self._driver = None

    def _stop(self) -> None:
        """Kill every process of the sandbox (for bwrap: its PID namespace ends with its PID 1)."""
        if self._proc is None:
            return
        procs = _tree(self._proc.pid)
        if self.isolation == "none":  # the supervisor is the process itself: killed first, it starts no new shell
            procs.insert(0, (self._proc.pid, 0))
        _kill(procs)  # the sandbox's processes first, so bwrap reaps its PID 1 and exits
        try:
            self._proc.wait(timeout=KILL_GRACE_SEC)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc.wait()
        for fd in (self._requests, self._status, self._out, self._err):
            os.close(fd)
        self._proc = None

    def close(self) -> None:
        try:
            if self.keep and self.isolation == "bwrap" and self._proc is not None and self._proc.poll() is None:
                self._export()
        finally:
            try:
                self._stop()
                if self._cgroup is not None:  # also kills what left the process tree (setsid + reparenting)
                    group, self._cgroup = self._cgroup, None
                    group.remove()
            finally:
                if not self.keep:
                    remove_tree(self.base)

    def _export(self) -> None:
        """keep=True: copy the writable mounts out to BASE/root (tar inside, a safe extract here)."""
        for mount in self.mounts:
            data = self.get_tree(mount)
            target = self._host(mount)
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                tar.extractall(target, filter=_export_filter)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- files -----------------------------------------------------------------------------------
    def write(self, rel: str, text: str | bytes, mode: int | None = None) -> None:
        """Write a file under the working directory (before the shell starts: with the first command)."""
        data = text.encode() if isinstance(text, str) else text
        if ".." in PurePosixPath(rel).parts or PurePosixPath(rel).is_absolute():
            raise ValueError(f"write: {rel!r} must be a relative path without '..'")
        if self._proc is None and self.num_restarts == 0:
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644 if mode is None else mode, 0
            self._seed.addfile(info, io.BytesIO(data))
            self._num_seeded += 1
            return
        target = str(PurePosixPath(self.workdir) / rel)
        res = self.put(data, target, mode)
        if res.exit_code != 0:
            raise SandboxError(f"write of {target} inside the sandbox failed (exit {res.exit_code}): {res.stderr.strip()}")

    def add_tree(self, host_dir: str | Path) -> None:
        """Copy a host directory's contents into the working directory (before the first command)."""
        if self._proc is not None or self.num_restarts:
            raise RuntimeError("add_tree: the sandbox has started; use put_tree")
        self._seed.add(str(host_dir), arcname=".")
        self._num_seeded += 1

    def _xfer(self, data: bytes) -> tuple[Path, str]:
        self._num_xfer += 1
        src = self.base / "xfer" / f"in-{self._num_xfer}"
        src.write_bytes(data)
        os.chmod(src, 0o644)
        return src, (f"/run/ds_ttt/{src.name}" if self.isolation == "bwrap" else str(src))

    def put(self, data: bytes, target: str, mode: int | None = None) -> CommandResult:
        """Copy `data` to `target` (a path inside, resolved inside the sandbox)."""
        src, inside = self._xfer(data)
        q, dst = shlex.quote, shlex.quote(self._inside(target))
        cmd = f'mkdir -p -- "$(dirname -- {dst})" && cat -- {q(inside)} > {dst}'
        if mode is not None:
            cmd += f" && chmod {mode:o} -- {dst}"
        try:
            return self.run_fresh(cmd, timeout=max(self.timeout, 60.0))
        finally:
            src.unlink()

    def put_tree(self, tar_data: bytes, target_dir: str) -> CommandResult:
        """Unpack a tar archive into `target_dir` (inside; made if missing)."""
        src, inside = self._xfer(tar_data)
        dst = shlex.quote(self._inside(target_dir))
        try:
            return self.run_fresh(f"mkdir -p -- {dst} && tar -xpf {shlex.quote(inside)} --no-same-owner -C {dst}",
                                  timeout=max(self.timeout, 60.0))
        finally:
            src.unlink()

    def read(self, path: str) -> bytes:
        """The bytes of file `path` (inside); SandboxError if it cannot be read."""
        res = self.run_fresh(f"cat -- {shlex.quote(self._inside(path))}", timeout=max(self.timeout, 60.0),
                             max_output_bytes=MAX_TRANSFER_BYTES)
        if res.exit_code != 0 or res.output_truncated:
            raise SandboxError(f"read of {path} failed (exit {res.exit_code}): {res.stderr.strip()}")
        return res.raw

    def get_tree(self, path: str) -> bytes:
        """A tar archive of directory `path` (inside)."""
        res = self.run_fresh(f"tar -c -C {shlex.quote(self._inside(path))} .", timeout=max(self.timeout, 60.0),
                             max_output_bytes=MAX_TRANSFER_BYTES)
        if res.exit_code != 0 or res.output_truncated:
            raise SandboxError(f"archiving {path} failed (exit {res.exit_code}): {res.stderr.strip()}")
        return res.raw

    # ---- commands --------------------------------------------------------------------------------
    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run `command` in the episode's shell (state carries over); stderr is merged into the output."""
        return self._request("shell", command, command, timeout)

    def run_fresh(self, command: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, max_output_bytes: int | None = None) -> CommandResult:
        """Run `bash -c command` in a new shell inside the same sandbox (as `docker exec` does): nothing
        of the episode shell's state; stdout and stderr apart. Processes it leaves keep running."""
        q = shlex.quote
        variables = dict(self.env, **(env or {}))
        snippet = (f"cd -- {q(self._inside(cwd or self.workdir))} && exec env -i "
                   + " ".join(q(f"{k}={v}") for k, v in variables.items())
                   + f" bash --noprofile --norc -c {q(command)}")
        return self._request("fresh", snippet, command, timeout, max_output_bytes)

    def _request(self, kind: str, payload: str, command: str, timeout: float | None,
                 max_output_bytes: int | None = None) -> CommandResult:
        """Send one command to the persistent shell and collect its result: (re)start the shell, drop a
        background fork bomb's leftovers, write the request, read until the status, stop it at the
        timeout or the output cap, recover a shell that died or hung, check the process limit.

        One function on purpose: these steps share the output buffers, the process set from before the
        command and the stop marks, and their order is the protocol with the shell (what is drained
        when, what is killed before what), which reads best in one place."""
        if "\0" in payload:
            return CommandResult(command, "[error: the command contains a NUL byte]", 2)
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()  # cannot happen short of a kernel OOM kill: PID 1 ignores signals from inside
            self._pending_note = (True, self.isolation == "bwrap")
            self.num_restarts += 1
        if self._proc is None:
            self._start()
        timeout = self.timeout if timeout is None else timeout
        cap = self.max_output_bytes if max_output_bytes is None else max_output_bytes
        out, err = bytearray(), bytearray()
        self._drain(self._out, out, cap)  # what background jobs printed since the last command comes first
        if self.isolation == "bwrap" and self._at_process_limit():
            # an earlier command's background fork bomb grew after that command ended: kill it, and drop
            # what it printed since (its "fork: retry" noise is not this command's output)
            self._kill_new(set())
            time.sleep(0.05)
            self._drain(self._out, bytearray(), 1 << 30)
            self._drain(self._err, bytearray(), 1 << 30)
            self._reap_notices(bytearray(), bytearray())
        before = set(_tree(self._proc.pid))
        oom_before = self._oom_kills()  # above _oom_seen: a background job was killed at the memory cap meanwhile
        if oom_before > self._oom_seen:
            # have the shell take note of that job now, so bash's "Killed ..." notice does not open this command's
            # output (whether bash had already reaped it was a race); the result notes the kill instead
            self._reap_notices(out, err)
        request = f"{kind}\0{payload}\0".encode()
        while request:  # the shell reads as we write; a long command needs more than one pipe buffer
            select.select([], [self._requests], [])
            request = request[os.write(self._requests, request):]
        deadline = time.monotonic() + timeout
        timed_out = truncated = False
        status = self._collect(deadline, out, err, cap, oom_from=oom_before if self._cgroup is not None else None)
        memory_hit = status == ("oom", 0)  # the kernel killed a process at the memory cap: stop the command
        if status is None or memory_hit:
            status = None
            timed_out = not memory_hit and len(out) + len(err) <= cap
            truncated = not memory_hit and not timed_out
            self._drain(self._out, out, cap)
            self._drain(self._err, err, cap)
            marks = (len(out), len(err))  # what the command printed before it was stopped is its output
            if self._driver is not None:
                try:
                    os.kill(self._driver[0], signal.SIGUSR1)  # first, so the shell abandons the command line
                except ProcessLookupError:
                    pass
            if memory_hit:
                # The OOM killer may have taken the shell itself (a command substitution holds its output in
                # the shell). The supervisor would then start a new shell, which the kill rounds must not
                # take for one of the command's processes: it is stopped (SIGSTOP reaches a PID 1 from the
                # host) until they are done, then reports the old shell's exit, if it ended, and starts one.
                _kill([self._supervisor], signal.SIGSTOP)
                try:
                    self._kill_new(before)
                finally:
                    _kill([self._supervisor], signal.SIGCONT)
                status = self._collect(time.monotonic() + KILL_GRACE_SEC, out, err, cap, stop_at_cap=False)
            else:
                self._kill_new(before)
                status = self._collect(time.monotonic() + KILL_GRACE_SEC, out, err, cap, before)
        else:
            marks = None
        restarted, lost = self._pending_note
        self._pending_note = (False, False)
        if status is None:  # the shell itself is busy (a builtin loop): kill it, the supervisor starts another
            _kill(p for p in _tree(self._proc.pid) if p != self._supervisor)
            status = self._collect(time.monotonic() + KILL_GRACE_SEC, out, err, cap, stop_at_cap=False)
            if status is None or status[0] != "exit":
                self._stop()
                lost = self.isolation == "bwrap"
            restarted = True
            self.num_restarts += 1
        elif status[0] == "exit":
            restarted = True
            self.num_restarts += 1
        if restarted and self._proc is not None:
            kind_, value = self._next_status(time.monotonic() + KILL_GRACE_SEC)
            if kind_ == "ready":
                self._find_driver(value)
            else:
                self._stop()
                lost = self.isolation == "bwrap"
        if marks is not None and not restarted and self._proc is not None:
            self._reap_notices(out, err)  # the jobs killed at the stop (cut below with the rest after it)
        oom_after = self._oom_kills()
        memory_hit = memory_hit or oom_after > oom_before  # also: one of its processes died at the cap as it ended
        if memory_hit and (marks is None or restarted) and self._proc is not None:
            self._kill_new(before)  # what the command left (its shell may have been the one killed)
            if not restarted:
                time.sleep(0.05)
                self._reap_notices(out, err)
        memory_earlier, self._oom_seen = oom_before > self._oom_seen, oom_after
        at_limit = False
        if self._proc is not None and self.isolation == "bwrap" and (
                self._at_process_limit() or (time.sleep(LIMIT_RECHECK_SEC) is None and self._at_process_limit())):
            at_limit = True  # a fork bomb in the background would hold the sandbox at its limit for good
            self._kill_new(before)
            time.sleep(0.05)  # let the dying processes' last output arrive
            self._reap_notices(out, err)
        if self._proc is not None:
            self._drain(self._out, out, cap)
            self._drain(self._err, err, cap)
        if marks is not None:  # drop what came after the stop (bash's "Killed" notes, the trap's leftovers)
            del out[marks[0]:], err[marks[1]:]
        truncated = truncated or len(out) + len(err) > cap
        code = 124 if timed_out else 137 if memory_hit and marks is not None else (status[1] if status is not None else 137)
        raw = bytes(out[:cap])
        return CommandResult(command, raw.decode("utf-8", "replace"), code, timed_out=timed_out,
                             output_truncated=truncated, output_bytes=len(out), shell_restarted=restarted,
                             files_lost=lost, stderr=bytes(err[:cap]).decode("utf-8", "replace"), raw=raw,
                             process_limit_hit=at_limit, memory_limit_hit=memory_hit, memory_limit_earlier=memory_earlier,
                             memory_limit_bytes=self.caps.memory_bytes if self._cgroup is not None else 0)

    def _reap_notices(self, out: bytearray, err: bytearray) -> None:
        """Have the shell take note of the jobs the host just killed, so its "Killed" notices are not
        printed into the next command's output (the result already says the sandbox killed them).
        What background jobs print meanwhile goes to `out`/`err`. The answer ("reaped") is waited for
        up to the grace time; one that comes later (a machine under heavy load) is skipped wherever it
        arrives, so a slow reap costs at most a notice, never a command's status. If the shell ended
        meanwhile, the supervisor's new shell is awaited and the next result says it was restarted."""
        select.select([], [self._requests], [])
        os.write(self._requests, b"reap\0\0")  # 7 bytes: always written whole to a pipe with room
        status = self._collect(time.monotonic() + KILL_GRACE_SEC, out, err, 1 << 30, stop_at_cap=False,
                               reaped=True)
        if status is not None and status[0] == "exit":
            self.num_restarts += 1
            kind, _value = self._next_status(time.monotonic() + KILL_GRACE_SEC)
            lost = kind != "ready"
            if lost:
                self._stop()
            self._pending_note = (True, lost and self.isolation == "bwrap")

    def _collect(self, deadline: float, out: bytearray, err: bytearray, cap: int,
                 before: set | None = None, stop_at_cap: bool = True,
                 reaped: bool = False, oom_from: int | None = None) -> tuple[str, int] | None:
        """Read output until the shell reports ("status"|"exit", code), or with `reaped` also ("reaped", 0)
        (else that answer is skipped); None at the deadline or past the cap (with `before` given, keep
        killing what the command started while waiting); with `oom_from`, ("oom", 0) as soon as the
        cgroup's OOM-kill count is above it (looked at every OOM_POLL_SEC)."""
        fds = [self._out, self._err, self._status]
        stop_at_cap = stop_at_cap and before is None
        wake = 0.05 if before is not None else (OOM_POLL_SEC if oom_from is not None else None)
        next_oom_check = time.monotonic() + OOM_POLL_SEC
        while True:
            st = self._pop_status(reaped=reaped)
            if st is not None:
                return st
            now = time.monotonic()
            left = deadline - now
            if left <= 0 or (stop_at_cap and len(out) + len(err) > cap):
                return None
            if oom_from is not None and now >= next_oom_check:
                next_oom_check = now + OOM_POLL_SEC
                if self._cgroup.oom_kills() > oom_from:
                    return ("oom", 0)
            for fd in select.select(fds, [], [], left if wake is None else min(left, wake))[0]:
                if fd != self._status:  # a status line is taken at the top of the loop
                    self._drain(fd, out if fd == self._out else err, cap)
            if before is not None:
                self._kill_new(before)

    def _next_status(self, deadline: float) -> tuple[str, int] | tuple[None, None]:
        """The next line of the status pipe, "ready" included (a late reap answer is skipped)."""
        while True:
            st = self._pop_status(keep_ready=True)
            if st is not None:
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                return None, None
            select.select([self._status], [], [], left)

    def _pop_status(self, *, reaped: bool = False, keep_ready: bool = False) -> tuple[str, int] | None:
        """The next status line for the caller, None when no complete line has arrived. Every complete
        line is looked at, buffered ones first (two lines can come in one read: a skipped one must not
        leave the next waiting in the buffer while the caller waits on the pipe): "ready" records the
        new shell's pid (and is returned with `keep_ready`), "reaped" is skipped unless asked for."""
        while (st := self._read_status_line()) is not None:
            if st[0] == "ready":
                self._find_driver(st[1])
                if keep_ready:
                    return st
            elif st[0] != "reaped" or reaped:
                return st
        return None

    def _read_status_line(self) -> tuple[str, int] | None:
        """One line of the status pipe: ("status", code), ("exit", code), ("ready", inner pid), ("reaped", 0);
        EOF -> ("exit", 137)."""
        while b"\n" not in self._status_buf:
            try:
                chunk = os.read(self._status, 64)
            except BlockingIOError:
                return None
            if not chunk:
                return ("exit", 137) if not self._status_buf else None
            self._status_buf += chunk
        line, self._status_buf = self._status_buf.split(b"\n", 1)
        words = line.decode(errors="replace").split()
        try:
            if len(words) == 1:
                return ("status", int(words[0]))
            if len(words) == 2 and words[0] in ("exit", "ready", "reaped"):
                return (words[0], int(words[1]))
        except ValueError:
            pass
        return ("exit", 137)  # not the protocol: treat the shell as gone

    @staticmethod
    def _drain(fd: int, buf: bytearray, cap: int) -> None:
        """Read what is there; keep at most cap + 1 bytes in buf (the rest is counted as dropped)."""
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    return
                raise
            if not chunk:
                return
            buf += chunk[: max(0, cap + 1 - len(buf))]
            if len(buf) > cap:
                return

    def _at_process_limit(self) -> bool:
        """Is the sandbox running a fork bomb's worth of processes? (BOMB_FRACTION of its limit: far
        more than the background jobs a task leaves, long before the bomb has filled the table)"""
        return len(_tree(self._proc.pid)) >= BOMB_FRACTION * self.max_processes

    def _kill_new(self, before: set[tuple[int, int]]) -> None:
        """SIGKILL every process of the sandbox that is not the supervisor, the shell or from an earlier command.

        A fork bomb refills the process table as fast as processes die, so each round first stops
        (SIGSTOP) every victim, which can then fork no more, and only then kills them; rounds repeat
        until none is left or KILL_ROUNDS_SEC has passed."""
        keep = before | {self._supervisor, self._driver}
        deadline = time.monotonic() + KILL_ROUNDS_SEC
        while time.monotonic() < deadline:
            victims = [p for p in _tree(self._proc.pid) if p not in keep]
            if not victims:
                return
            _kill(victims, signal.SIGSTOP)
            _kill(victims)
            time.sleep(0.002)

def _export_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "tar" filter (nothing lands outside dest, even through links extracted before; no setuid
    bits) that also drops device nodes; links are kept as links, never followed."""
    if member.ischr() or member.isblk():
        return None
    return tarfile.tar_filter(member, dest)


def _check_reachable(base: Path) -> None:
    """bwrap runs as HOST_UID_FOR_ROOT when the caller is root: every parent of BASE must be searchable by it."""
    for parent in base.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            shutil.rmtree(base, ignore_errors=True)
            raise SandboxError(f"{parent} is not searchable by other users (mode {stat.filemode(os.stat(parent).st_mode)}), "
                               f"but the sandbox runs as uid {HOST_UID_FOR_ROOT} because the caller is root: put the "
                               f"sandbox elsewhere (parent=, e.g. under /tmp), `chmod o+x {parent}`, or run as a non-root user")


def format_observation(result: CommandResult, max_chars: int = 2000) -> str:
    """The tool-result text the agent sees: the real output, trimmed of trailing newlines, with the exit
    status appended when non-zero (and a note when the command timed out, the output was cut, or the
    shell had to be restarted)."""
    out = result.output.rstrip("\n")
    notes = []
    if result.output_truncated:
        out = out[:max_chars]
        notes.append(f"[output truncated: the command was killed after {result.output_bytes} bytes of output]")
    elif len(out) > max_chars:
        notes.append(f"[output truncated: {len(result.output)} chars]")
        out = out[:max_chars]
    if result.timed_out:
        notes.append("[command timed out]")
    elif not result.output_truncated and result.exit_code != 0:
        notes.append(f"[exit code: {result.exit_code}]")
    if result.process_limit_hit:
        notes.append("[the sandbox was at its process limit: every process this command started was killed]")
    if result.memory_limit_earlier:
        notes.append(f"[a background process was killed: the sandbox reached its memory limit of "
                     f"{result.memory_limit_bytes >> 20} MiB after the previous command]")
    if result.memory_limit_hit and result.exit_code == 137:
        notes.append(f"[command killed: the sandbox reached its memory limit of {result.memory_limit_bytes >> 20} MiB]")
    elif result.memory_limit_hit:  # the command line ended before the host saw the kill (see the module docstring)
        notes.append(f"[a process of this command was killed: the sandbox reached its memory limit of "
                     f"{result.memory_limit_bytes >> 20} MiB]")
    if result.files_lost:
        notes.append("[the sandbox was restarted: its files are lost; the working directory, variables and "
                     "background jobs are reset]")
    elif result.shell_restarted:
        notes.append("[the shell was restarted: files are kept; the working directory, variables and background "
                     "jobs are reset]")
    if notes:
        out += ("\n" if out else "") + "\n".join(notes)
    return out if out else "(no output)"
