"""The one sandbox in which model-written and scripted bash commands run: bubblewrap plus a persistent shell.

    with Sandbox(timeout=5.0) as sb:                  # refuses (SandboxError) without a working `bwrap`
        sb.write("notes.txt", "hello\\n")             # lands in /app/notes.txt inside
        sb.run("cd sub 2>/dev/null; export N=3")       # one bash per episode: cd, variables, jobs carry over
        result = sb.run("wc -l notes.txt; echo $N")    # CommandResult(output, exit_code, timed_out, ...)
    Sandbox(isolation="none")                          # an explicit choice to run without it (--no-isolation)

Used by the trajectory generator (`generator.py`), the serve runner (`ds_ttt/serve/runner.py`) and the
Harbor environment (`ds_ttt/serve/harbor_env.py`). docs/sandbox.md says what it protects against and
what it does not; tests/unit/test_sandbox_hostile.py is the attack suite that backs those claims.

Layout. A fresh host directory BASE holds `root/` (R), the episode's own writable `/`. Inside the
sandbox R is `/`; the working directory is `/app` (R/app, `sb.root` on the host), and `/tmp`,
`/var/tmp` are R's own directories. `bwrap` (bubblewrap) builds the rest over R:

  bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL
        --uid 1000 --gid 1000 --bind R / --ro-bind /usr /usr  (+ /bin /lib /lib64 /sbin links or ro binds)
        --ro-bind /etc /etc  (/etc/passwd, /etc/group replaced by the sandbox's own)
        --proc /proc --dev /dev --tmpfs /dev/shm --tmpfs /run (size-capped) -- bash DRIVER

so inside there is no network (a fresh network namespace: its own loopback only, and abstract Unix
sockets are per network namespace), an unprivileged uid 1000 with no capabilities and no further user
namespaces, a private PID namespace (no host process is visible), and no host path except the
read-only system directories: host homes, the project checkout, host sockets (/run, /tmp, /dev/shm)
and other sandboxes' directories do not exist there. When the caller is root, bwrap itself runs as
uid 65534 (so that the kernel enforces the process limit, which it never does for the host's root);
the sandbox's files then belong to 65534 on the host.

The persistent shell. One `bash` (the DRIVER below) lives for the whole episode. The host sends each
command NUL-terminated on the shell's stdin; the shell `eval`s it in itself (stdin /dev/null, stderr
merged into stdout), then writes `$?` to a separate status pipe. So `cd`, `export`, functions and
background jobs carry over, the output is exactly the command's bytes, and the exit code is exact.
At the timeout or the output cap, every process that the command started is killed (the host walks
the sandbox's process tree, sparing the shell and jobs from earlier commands); the shell then reports
the status and lives on. If the shell itself is what runs (a builtin loop) or it exited, the whole
sandbox is killed and a new shell starts at the next command in the same R: the files stay, the
working directory, variables and jobs do not, and the observation says so.

Limits (per sandbox): at most `max_processes` processes (RLIMIT_NPROC, counted in the sandbox's own
user namespace), `max_memory_bytes` of address space per process (RLIMIT_AS), `max_file_bytes` per
file (RLIMIT_FSIZE), `max_cpu_seconds` of CPU per process (RLIMIT_CPU), no core files,
`max_output_bytes` of output read per command (past it the command is killed and the result marked
truncated), and `max_disk_bytes` / `MAX_DISK_FILES` in R (measured by the host every second while a
command runs and after it; past it the command is killed). `isolation="none"` keeps the persistent
shell, the output cap and the timeouts, and nothing else: commands run as the caller, in the host's
filesystem, network and process table.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import select
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LC_ALL": "C",
    "LANG": "C",
    "TERM": "dumb",
    "TZ": "UTC",
    "SHELL": "/bin/bash",
}
ISOLATION_CHOICES = ("required", "none")
INSTALL_HINT = "apt-get install bubblewrap (setup.sh does this)"
WORKDIR = "/app"
SANDBOX_UID = 1000  # the uid inside; it has no capabilities
HOST_UID_FOR_ROOT = 65534  # bwrap runs as this uid when the caller is root (the kernel exempts root from RLIMIT_NPROC)
MAX_OUTPUT_BYTES = 1 << 20  # what the host reads of one command's output before killing it
MAX_PROCESSES = 256
MAX_FILE_BYTES = 1 << 30  # RLIMIT_FSIZE: the largest file a command may write
MAX_MEMORY_BYTES = 4 << 30  # RLIMIT_AS per process
MAX_CPU_SECONDS = 600  # RLIMIT_CPU per process
MAX_DISK_BYTES = 2 << 30  # R's size, measured by the host
MAX_DISK_FILES = 100_000  # R's entries, measured by the host
TMPFS_BYTES = 64 << 20  # /dev/shm and /run (memory-backed)
SYSTEM_DIRS = ("usr", "etc")  # bound read-only
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr links, or read-only binds
KILL_GRACE_SEC = 2.0  # after killing a command's processes, how long the shell has to report its status
DISK_CHECK_SEC = 1.0
_READ_CHUNK = 1 << 16

# The persistent shell. Requests arrive NUL-terminated on stdin: a kind ("shell" or "fresh") and a
# command. "shell" runs in this shell; "fresh" in a subshell with stderr on fd 4 (Harbor's exec).
# The status goes to fd 3; the command never holds fds 3 and 4 (or the request pipe).
DRIVER = ("__ds_ttt_limits; "  # one line, so that bash reports errors as `bash: line 1: ...`, as `bash -c` does
          "while builtin read -r -d '' __ds_kind && builtin read -r -d '' __ds_cmd; do "
          "if [ \"$__ds_kind\" = shell ]; then { builtin eval \"$__ds_cmd\"; } </dev/null 2>&1 3>&- 4>&-; "
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
    shell_restarted: bool = False  # the shell exited or had to be killed: a new one starts next time
    disk_limit_exceeded: bool = False  # R passed max_disk_bytes / MAX_DISK_FILES: the command was killed
    stderr: str = ""  # only for run_fresh (Harbor's exec); run() merges stderr into output


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _refuse_text(problem: str) -> str:
    return (f"the sandbox is unavailable here: {problem}. Install bubblewrap ({INSTALL_HINT}). To run commands "
            f"without it, with this machine's network, files and process table, pass --no-isolation "
            f"(data_prep/generate.py, the serve runner) or Sandbox(isolation='none') / generate(..., isolation='none').")


@functools.lru_cache(maxsize=1)
def isolation_problem() -> str | None:
    """None when bubblewrap sandboxes work here, else why not (probed once per process).

    The probe starts a real sandbox and checks from the host that a file written to `/` inside landed
    in R, that the uid inside is not 0, and that a TCP port listening on the host's 127.0.0.1 is not
    reachable."""
    if bwrap_path() is None:
        return "`bwrap` is not on PATH"
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        try:
            with Sandbox(timeout=10.0, _probe=True) as sb:
                res = sb.run(f"touch /probe; id -u; (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo REACHABLE; true")
                if res.exit_code != 0:
                    return f"the probe command exited {res.exit_code}: {res.output.strip()[:300]}"
                if not (sb.fs_root / "probe").is_file():
                    return "a file written to / inside the sandbox did not land in its root directory"
                if res.output.split()[:1] != [str(SANDBOX_UID)]:
                    return f"the uid inside the sandbox is {res.output.strip()[:50]!r}, not {SANDBOX_UID}"
                if "REACHABLE" in res.output:
                    return "the host's 127.0.0.1 is reachable from inside the sandbox"
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


def disk_usage(root: Path, max_entries: int = MAX_DISK_FILES) -> tuple[int, int]:
    """(bytes allocated, entries) under `root`, never following links; stops counting past max_entries."""
    total, entries, stack = 0, 0, [str(root)]
    while stack and entries <= max_entries:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                entries += 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return total, entries


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


class Sandbox:
    """One episode's sandbox: a root directory R, one persistent bash in bwrap, `run(command)`.

    isolation: "required" (default) refuses with `SandboxError` when bwrap does not work here; "none"
    runs the same shell without it. `self.isolation` is what is used ("bwrap" or "none"): record it.
    A context manager: `close()` kills every process of the sandbox and removes BASE unless `keep`.
    """

    def __init__(self, parent: str | None = None, keep: bool = False, timeout: float = 5.0, *,
                 isolation: str = "required", workdir: str = WORKDIR, home: str | None = None,
                 env: dict[str, str] | None = None, dirs: tuple[str, ...] = (),
                 max_output_bytes: int = MAX_OUTPUT_BYTES, max_processes: int = MAX_PROCESSES,
                 max_memory_bytes: int = MAX_MEMORY_BYTES, max_file_bytes: int = MAX_FILE_BYTES,
                 max_cpu_seconds: int = MAX_CPU_SECONDS, max_disk_bytes: int = MAX_DISK_BYTES,
                 _probe: bool = False):
        if max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
        if not PurePosixPath(workdir).is_absolute():
            raise ValueError(f"workdir must be an absolute path inside the sandbox, got {workdir!r}")
        self.isolation = "bwrap" if _probe else resolve_isolation(isolation)
        self._bwrap = bwrap_path()
        if self.isolation == "bwrap" and self._bwrap is None:
            raise SandboxError(_refuse_text("`bwrap` is not on PATH"))
        self.base = Path(tempfile.mkdtemp(prefix="ds_ttt_sbx_", dir=parent)).resolve()
        os.chmod(self.base, 0o711)  # bwrap (maybe as HOST_UID_FOR_ROOT) must reach R; nobody may list BASE
        self.fs_root = self.base / "root"  # `/` inside
        self.keep, self.timeout = keep, timeout
        self.max_output_bytes, self.max_processes = max_output_bytes, max_processes
        self.max_memory_bytes, self.max_file_bytes = max_memory_bytes, max_file_bytes
        self.max_cpu_seconds, self.max_disk_bytes = max_cpu_seconds, max_disk_bytes
        self._as_uid = HOST_UID_FOR_ROOT if (os.geteuid() == 0 and self.isolation == "bwrap") else None
        if self._as_uid is not None:
            _check_reachable(self.base)
        self.workdir = workdir
        self.home = home or workdir
        if self.isolation == "bwrap":
            self._inside = lambda p: p  # paths inside are paths inside
        else:  # no mount namespace: "/app" is R/app on the host
            self._inside = lambda p: str(self.fs_root / PurePosixPath(p).relative_to("/"))
        self.env = dict(SANDBOX_ENV, HOME=self._inside(self.home), TMPDIR=self._inside("/tmp"), **(env or {}))
        for d in ("", "tmp", "var/tmp", *[PurePosixPath(x).relative_to("/") for x in (workdir, self.home, *dirs)]):
            (self.fs_root / d).mkdir(parents=True, exist_ok=True)
        for d in ("tmp", "var/tmp"):
            os.chmod(self.fs_root / d, 0o1777)
        self.root = self.fs_root / PurePosixPath(workdir).relative_to("/")  # the working directory, on the host
        (self.base / "xfer").mkdir()  # uploads, bound read-only at /run/ds_ttt (never writable inside)
        self._write_identity()
        self._chown_tree(self.fs_root)
        self._proc: subprocess.Popen | None = None
        self._requests = self._status = self._err = None
        self._protected: set[tuple[int, int]] = set()
        self._started_once = False
        self._restart_note = False  # the shell died between commands: say so in the next result
        self._num_xfer = 0
        self.num_restarts = 0

    # ---- setup ---------------------------------------------------------------------------------
    def _write_identity(self) -> None:
        (self.base / "passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                          f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:{self.home}:/bin/bash\n"
                                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (self.base / "group").write_text(f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")

    def _chown_tree(self, top: Path) -> None:
        """When bwrap runs as HOST_UID_FOR_ROOT, what the host put in R must be that uid's (never following links)."""
        if self._as_uid is None:
            return
        os.lchown(top, self._as_uid, self._as_uid)
        for dirpath, dirnames, filenames in os.walk(top):
            for n in dirnames + filenames:
                os.lchown(os.path.join(dirpath, n), self._as_uid, self._as_uid)

    def _argv(self, st_fd: int, err_fd: int, src: dict[str, int] | None = None) -> list[str]:
        limits = (f"exec 3>&{st_fd} 4>&{err_fd} {st_fd}>&- {err_fd}>&-; "
                  f"ulimit -c 0 -t {self.max_cpu_seconds} -f {self.max_file_bytes // 1024} -v {self.max_memory_bytes // 1024}")
        if self.isolation == "none":
            return ["bash", "--noprofile", "--norc", "-c", DRIVER.replace("__ds_ttt_limits", limits), "bash"]
        limits += f" -u {self.max_processes}"
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--hostname", "sandbox", "--bind", f"/proc/self/fd/{src['root']}", "/"]
        for name in SYSTEM_DIRS:
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
        for name in SYSTEM_LINKS:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        # Sources in BASE are passed as O_PATH descriptors: BASE's parents may be closed to HOST_UID_FOR_ROOT
        argv += ["--ro-bind", f"/proc/self/fd/{src['passwd']}", "/etc/passwd",
                 "--ro-bind", f"/proc/self/fd/{src['group']}", "/etc/group",
                 "--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/dev/shm",
                 "--size", str(TMPFS_BYTES), "--tmpfs", "/run", "--ro-bind", f"/proc/self/fd/{src['xfer']}", "/run/ds_ttt",
                 "--chdir", self.workdir, "--", "bash", "--noprofile", "--norc", "-c",
                 DRIVER.replace("__ds_ttt_limits", limits), "bash"]
        return argv

    def _start(self) -> None:
        """Start bwrap and the shell, and wait for the shell to answer a first no-op request."""
        for name in SYSTEM_LINKS:  # bwrap made these links in R last time (or a command replaced them)
            p = self.fs_root / name
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
            elif p.is_dir():
                remove_tree(p)
        pipes = [os.pipe() for _ in range(4)]  # requests, status, output, fresh stderr
        (req_r, req_w), (st_r, st_w), (out_r, out_w), (err_r, err_w) = pipes
        # the status and stderr pipes reach the shell as fds >= 10; the driver moves them to 3 and 4
        st_child, err_child = fcntl.fcntl(st_w, fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(err_w, fcntl.F_DUPFD_CLOEXEC, 10)
        src = {"root": self.fs_root, "passwd": self.base / "passwd", "group": self.base / "group", "xfer": self.base / "xfer"}
        src = {k: os.open(v, os.O_PATH | os.O_CLOEXEC) for k, v in src.items()} if self.isolation == "bwrap" else {}
        argv = self._argv(st_child, err_child, src)
        user = {} if self._as_uid is None else {"user": self._as_uid, "group": self._as_uid, "extra_groups": []}
        try:
            self._proc = subprocess.Popen(argv, stdin=req_r, stdout=out_w, stderr=out_w, env=self.env,
                                          cwd="/" if self.isolation == "bwrap" else self.root, start_new_session=True,
                                          pass_fds=(st_child, err_child, *src.values()), **user)
        except OSError as e:
            raise SandboxError(f"could not start the sandbox ({argv[0]}): {e}") from e
        finally:
            for fd in (req_r, st_w, out_w, err_w, st_child, err_child, *src.values()):
                os.close(fd)
        for fd in (st_r, out_r, err_r):
            os.set_blocking(fd, False)
        self._requests, self._status, self._out, self._err = req_w, st_r, out_r, err_r
        self._status_buf = b""
        self._protected = set()
        self._started_once = True
        res = self._request("shell", ":", ":", timeout=30.0, _starting=True)
        if res.exit_code != 0 or res.shell_restarted:
            raise SandboxError(f"the sandbox did not start (exit {res.exit_code}): {res.output.strip()[:2000]}"
                               )
        self._protected = set(self._processes())  # bwrap's init and the shell

    def _processes(self) -> list[tuple[int, int]]:
        return _tree(self._proc.pid) if self._proc is not None else []

    def _stop(self) -> None:
        """Kill every process of the sandbox (bwrap's outer process; its PID namespace dies with it)."""
        if self._proc is None:
            return
        procs = self._processes()
        for sig_target in [self._proc.pid] + [p for p, _ in procs]:
            try:
                os.kill(sig_target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._proc.wait()
        for fd in (self._requests, self._status, self._out, self._err):
            try:
                os.close(fd)
            except OSError:
                pass
        self._proc = None

    def close(self) -> None:
        self._stop()
        if not self.keep:
            remove_tree(self.base)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- files ---------------------------------------------------------------------------------
    def write(self, rel: str, text: str | bytes, mode: int | None = None) -> None:
        """Write a file under the working directory. Before the shell starts the host writes it directly;
        afterwards through the sandbox, so that a link made by a command cannot redirect a host write."""
        data = text.encode() if isinstance(text, str) else text
        if ".." in PurePosixPath(rel).parts or PurePosixPath(rel).is_absolute():
            raise ValueError(f"write: {rel!r} must be a relative path without '..'")
        if not self._started_once:
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if mode is not None:
                os.chmod(path, mode)
            self._chown_tree(self.fs_root)
            return
        target = str(PurePosixPath(self.workdir) / rel)
        res = self.put(data, target, mode)
        if res.exit_code != 0:
            raise SandboxError(f"write of {target} inside the sandbox failed (exit {res.exit_code}): {res.stderr.strip()}")

    def put(self, data: bytes, target: str, mode: int | None = None) -> CommandResult:
        """Copy `data` to `target` (a path inside), resolved inside the sandbox."""
        self._num_xfer += 1
        name = f"in-{self._num_xfer}"
        src = self.base / "xfer" / name
        src.write_bytes(data)
        os.chmod(src, 0o644)
        inside_src = f"/run/ds_ttt/{name}" if self.isolation == "bwrap" else str(src)
        q = shlex.quote
        dst = self._inside(target)
        cmd = f"mkdir -p -- \"$(dirname -- {q(dst)})\" && cat -- {q(inside_src)} > {q(dst)}"
        if mode is not None:
            cmd += f" && chmod {mode:o} -- {q(dst)}"
        try:
            return self.run_fresh(cmd, timeout=max(self.timeout, 60.0))
        finally:
            src.unlink()

    # ---- commands ------------------------------------------------------------------------------
    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run `command` in the episode's shell (state carries over); stderr is merged into the output."""
        return self._request("shell", command, command, timeout)

    def run_fresh(self, command: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, max_output_bytes: int | None = None) -> CommandResult:
        """Run `bash -c command` in a new shell inside the same sandbox (as `docker exec` does): nothing
        of the episode shell's state, stdout and stderr apart. Processes it leaves keep running."""
        q = shlex.quote
        variables = dict(self.env, **(env or {}))
        snippet = (f"cd -- {q(self._inside(cwd or self.workdir))} && exec env -i "
                   + " ".join(q(f"{k}={v}") for k, v in variables.items())
                   + f" bash --noprofile --norc -c {q(command)}")
        return self._request("fresh", snippet, command, timeout, max_output_bytes)

    def _request(self, kind: str, payload: str, command: str, timeout: float | None,
                 max_output_bytes: int | None = None, _starting: bool = False) -> CommandResult:
        if "\0" in payload:
            return CommandResult(command, "[error: the command contains a NUL byte]", 2)
        if self._proc is not None and not _starting and self._proc.poll() is not None:
            self._stop()  # the shell died since the last command (a background job killed it)
            self.num_restarts += 1
            self._restart_note = True
        if self._proc is None:
            self._start()
        timeout = self.timeout if timeout is None else timeout
        cap = self.max_output_bytes if max_output_bytes is None else max_output_bytes
        before = set(self._processes())
        request = f"{kind}\0{payload}\0".encode()
        try:
            while request:  # the shell reads as we write; a long command needs more than one pipe buffer
                request = request[os.write(self._requests, request):]
        except BrokenPipeError:
            self._stop()
            self.num_restarts += 1
            self._restart_note = True
            return self._request(kind, payload, command, timeout, max_output_bytes)
        out, err = bytearray(), bytearray()
        total = 0
        timed_out = truncated = disk = False
        status: int | None = None
        shell_gone = False
        deadline = time.monotonic() + timeout
        next_disk = time.monotonic() + DISK_CHECK_SEC
        fds = [self._out, self._err, self._status]
        while status is None and not shell_gone:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if self.isolation == "bwrap" and now >= next_disk:
                next_disk = now + DISK_CHECK_SEC
                if self._over_disk():
                    disk = True
                    break
            ready = select.select(fds, [], [], min(deadline - now, DISK_CHECK_SEC))[0]
            for fd in ready:
                if fd == self._status:
                    status, shell_gone = self._read_status()
                else:
                    n = self._drain(fd, out if fd == self._out else err, cap, total)
                    total += n
            if total > cap:
                truncated = True
                break
        if status is None and not shell_gone:  # timeout, output cap or disk: kill what the command started
            self._kill_new(before)
            grace = time.monotonic() + KILL_GRACE_SEC
            while status is None and not shell_gone and time.monotonic() < grace:
                ready = select.select(fds, [], [], 0.05)[0]
                for fd in ready:
                    if fd == self._status:
                        status, shell_gone = self._read_status()
                    else:
                        total += self._drain(fd, out if fd == self._out else err, cap, total)
                if status is None:
                    self._kill_new(before)
        else:
            total += self._drain(self._out, out, cap, total) + self._drain(self._err, err, cap, total)
        restarted, self._restart_note = self._restart_note, False
        if status is None or shell_gone:  # the shell exited or is itself stuck: a new one next time
            if shell_gone and status is None:
                try:
                    status = self._proc.wait(timeout=KILL_GRACE_SEC)
                except subprocess.TimeoutExpired:
                    pass
            self._stop()
            self.num_restarts += 1
            restarted = True
        if self.isolation == "bwrap" and not disk and self._over_disk():
            disk = True
        text = bytes(out[:cap]).decode("utf-8", "replace")
        err_text = bytes(err[:cap]).decode("utf-8", "replace")
        code = 124 if timed_out else (status if status is not None else 137)
        return CommandResult(command, text, code, timed_out=timed_out, output_truncated=truncated, output_bytes=total,
                             shell_restarted=restarted, disk_limit_exceeded=disk, stderr=err_text)

    def _read_status(self) -> tuple[int | None, bool]:
        try:
            chunk = os.read(self._status, 64)
        except BlockingIOError:
            return None, False
        if not chunk:
            return None, True  # the shell is gone
        self._status_buf += chunk
        if b"\n" not in self._status_buf:
            return None, False
        line, self._status_buf = self._status_buf.split(b"\n", 1)
        try:
            return int(line), False
        except ValueError:
            return None, True  # not our protocol any more: treat the shell as broken

    @staticmethod
    def _drain(fd: int, buf: bytearray, cap: int, total: int) -> int:
        n = 0
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return n
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    return n
                raise
            if not chunk:
                return n
            n += len(chunk)
            room = max(0, cap + 1 - len(buf))
            buf += chunk[:room]
            if total + n > cap:
                return n

    def _kill_new(self, before: set[tuple[int, int]]) -> None:
        """SIGKILL every process of the sandbox that is neither the shell, bwrap, nor from an earlier command."""
        keep = before | self._protected
        for _ in range(50):
            victims = [p for p in self._processes() if p not in keep]
            if not victims:
                return
            for pid, _start in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.002)

    def _over_disk(self) -> bool:
        used, entries = disk_usage(self.fs_root)
        return used > self.max_disk_bytes or entries > MAX_DISK_FILES


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
    status appended when non-zero (and a note when the command timed out, the output was cut, the disk
    limit was hit, or the shell had to be restarted)."""
    out = result.output.rstrip("\n")
    notes = []
    if result.output_truncated:
        out = out[:max_chars]
        notes.append(f"[output truncated: the command was killed after {result.output_bytes} bytes of output]")
    elif len(out) > max_chars:
        notes.append(f"[output truncated: {len(result.output)} chars]")
        out = out[:max_chars]
    if result.disk_limit_exceeded:
        notes.append("[disk limit exceeded: the command was killed]")
    if result.timed_out:
        notes.append("[command timed out]")
    elif not result.output_truncated and result.exit_code != 0:
        notes.append(f"[exit code: {result.exit_code}]")
    if result.shell_restarted:
        notes.append("[the shell was restarted: files are kept; the working directory, variables and background "
                     "jobs are reset]")
    if notes:
        out += ("\n" if out else "") + "\n".join(notes)
    return out if out else "(no output)"
