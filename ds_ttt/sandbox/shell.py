"""One episode's sandbox as an object: its process, its persistent shell, its files, its commands (`Shell`).

    with Shell(timeout=5.0) as sb:      # what `ds_ttt.sandbox.Sandbox` is, less probing the isolation first
        sb.write("notes.txt", "hi\\n")   # lands in /app/notes.txt inside
        sb.run("cd sub; export N=3")     # CommandResult (result.py); state carries over to the next run()
        sb.run_fresh("ls", cwd="/app")   # a new bash in the same sandbox, stdout and stderr apart

The pieces it puts together, one module each: bwrap.py (the bubblewrap command line), supervisor.py (the
shell code inside), protocol.py (requests and status lines), kill.py (the process tree, killing),
caps.py (the episode's cgroup), files.py (the host side of its directory), result.py (what a command
returns), refusal.py (the choices and `SandboxError`).

The persistent shell (supervisor.py): every command runs in one bash per episode, so `cd`, `export`,
functions and background jobs carry over. At the timeout or the output cap every process the command
started is killed (the host walks the sandbox's process tree, sparing the shell and jobs of earlier
commands) and the shell lives on. If the shell itself is what runs (a builtin loop), or it exited
(`exit 3`: exit code 3), the supervisor starts a new shell in the same sandbox: the files stay, the
working directory, variables and jobs do not, and the observation says so.

The host reaches the files only through the sandbox (`write`, `put`, `put_tree`, `read`, `get_tree`:
cat/tar run inside, so a link made by a command cannot redirect a host read or write); `keep=True`
exports the writable directories into BASE/root on close (`sb.root` is then the working directory's copy).

Limits: at most `max_processes` processes (RLIMIT_NPROC, counted in the sandbox's own user
namespace), `max_memory_bytes` of address space per process (RLIMIT_AS), `max_file_bytes` per file
(RLIMIT_FSIZE), `max_cpu_seconds` of CPU per process (RLIMIT_CPU), no core files, `max_output_bytes`
of output read per command (past it the command is killed, the result marked truncated), and the
tmpfs sizes (`max_disk_bytes` for the working directory, `max_scratch_bytes` for each other writable
directory). `isolation="none"` keeps the persistent shell, the output cap, the timeouts and the
per-process rlimits but not the process limit, and nothing else: commands run as the caller, in a
host directory BASE/root (/app is BASE/root/app), with the host's files, network and process table.

The whole episode (every process of the sandbox, whatever it forks) is also a cgroup of its own
(caps.py: v2, v1 or a systemd scope), made with the sandbox and removed at close: at most
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

import fcntl
import io
import os
import select
import shlex
import signal
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Self

from .bwrap import GROUP_TEXT, HOST_UID_FOR_ROOT, SYSTEM_TMPFS_BYTES, XFER_INSIDE, bwrap_argv, bwrap_path, check_reachable, passwd_text
from .caps import CgroupCaps, CgroupError, EpisodeCgroup, create_episode_cgroup
from .files import export_filter, remove_tree
from .kill import inner_pid, kill_all, kill_group, kill_rounds, process_tree, start_time
from .protocol import REAP_REQUEST, StatusReader, drain, encode_request
from .refusal import CGROUP_CAPS_CHOICES, ISOLATION_CHOICES, SandboxError, cgroup_refusal, isolation_refusal
from .result import CommandResult
from .supervisor import RUN_FUNCTION, shell_argv, ulimits

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LC_ALL": "C",
    "LANG": "C",
    "TERM": "dumb",
    "TZ": "UTC",
    "SHELL": "/bin/bash",
}
WORKDIR = "/app"
MAX_OUTPUT_BYTES = 1 << 20  # what the host reads of one command's output before killing it
MAX_PROCESSES = 256  # RLIMIT_NPROC inside (threads count)
BOMB_FRACTION = 0.25  # leftover processes at or above this share of MAX_PROCESSES are killed as a fork bomb
LIMIT_RECHECK_SEC = 0.02  # a background bomb below the limit when its command ends is there this much later
MAX_FILE_BYTES = 256 << 20  # RLIMIT_FSIZE: the largest file a command may write
MAX_MEMORY_BYTES = 4 << 30  # RLIMIT_AS per process
MAX_CPU_SECONDS = 600  # RLIMIT_CPU per process
MAX_DISK_BYTES = 1 << 30  # the working directory's tmpfs
MAX_SCRATCH_BYTES = 256 << 20  # each other writable tmpfs (/tmp, /var/tmp, HOME, dirs)
# The episode's cgroup (caps.py), sized for a 2-core 24 GiB machine running a few at once
EPISODE_MEMORY_BYTES = 4 << 30  # RAM of the whole tree, tmpfs files included; no swap beyond it
EPISODE_PROCESSES = MAX_PROCESSES + 16  # pids.max: RLIMIT_NPROC stops a bomb first; this also holds without it
EPISODE_CPUS = 1.0  # CPU time per wall second, all its processes together: one of the two cores
MEMORY_HEADROOM_BYTES = 64 << 20  # the memory cap must exceed the full tmpfs mounts by this (a shell must still run)
OOM_POLL_SEC = 0.05  # while a command runs, how often the host looks for an OOM kill in the cgroup
MAX_TRANSFER_BYTES = 1 << 30  # read() / get_tree()
KILL_GRACE_SEC = 2.0  # after a kill, how long the shell has to report


class Shell:
    """One episode's sandbox: bwrap, one persistent bash, `run(command)`, without probing first.

    Callers use `ds_ttt.sandbox.Sandbox`, which is this class with its `isolation` choice resolved by
    probe.py; this one trusts that bwrap works, so that the probe itself can start a sandbox.
    isolation: "required" (default) uses bwrap, "none" runs the same shell without it. `self.isolation`
    is what is used ("bwrap" or "none").
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
                 max_episode_cpus: float = EPISODE_CPUS):
        if max_output_bytes < 1:
            raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
        if cgroup_caps not in CGROUP_CAPS_CHOICES:
            raise ValueError(f"cgroup_caps={cgroup_caps!r}: choose one of {CGROUP_CAPS_CHOICES}")
        for path in (workdir, home or "/", *dirs):
            if not PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
                raise ValueError(f"sandbox paths must be absolute, without '..': got {path!r}")
        self.isolation = self._settle_isolation(isolation)
        self._bwrap = bwrap_path()
        if self.isolation == "bwrap" and self._bwrap is None:
            raise SandboxError(isolation_refusal("`bwrap` is not on PATH"))
        self._as_uid = HOST_UID_FOR_ROOT if (os.geteuid() == 0 and self.isolation == "bwrap") else None
        self.base = Path(tempfile.mkdtemp(prefix="ds_ttt_sbx_", dir=parent)).resolve()
        os.chmod(self.base, 0o711)  # bwrap (maybe as HOST_UID_FOR_ROOT) reads passwd/group/xfer; nobody lists BASE
        if self._as_uid is not None:
            check_reachable(self.base)
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
        (self.base / "passwd").write_text(passwd_text(self.home))
        (self.base / "group").write_text(GROUP_TEXT)
        self._proc: subprocess.Popen | None = None
        self._seed = tarfile.open(fileobj=io.BytesIO(), mode="w")  # files written before the shell starts
        self._num_seeded = 0
        self._num_xfer = 0
        self._supervisor = self._driver = None  # (host pid, start time)
        self._pending_note = (False, False)  # (shell restarted, files lost) to report with the next result
        self.num_restarts = 0
        self._oom_seen = 0  # the cgroup's OOM-kill count when the last result was made
        if cgroup_caps == "required":
            self._make_cgroup()

    @staticmethod
    def _settle_isolation(isolation: str) -> str:
        """The isolation used for the choice, "bwrap" or "none", unprobed (`Sandbox` resolves it with probe.py)."""
        if isolation not in ISOLATION_CHOICES:
            raise ValueError(f"isolation={isolation!r}: choose one of {ISOLATION_CHOICES}")
        return "none" if isolation == "none" else "bwrap"

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
        return XFER_INSIDE if self.isolation == "bwrap" else str(self.base / "xfer")

    def _host(self, inside: str) -> Path:
        return self.fs_root / PurePosixPath(inside).relative_to("/")

    def _inside(self, path: str) -> str:
        """A path inside the sandbox as the shell sees it ("none": under BASE/root on the host)."""
        return path if self.isolation == "bwrap" else str(self._host(path))

    # ---- the process -----------------------------------------------------------------------------
    def _argv(self, st_fd: int, err_fd: int) -> list[str]:
        limits = ulimits(self.max_cpu_seconds, self.max_file_bytes, self.max_memory_bytes,
                         self.max_processes if self.isolation == "bwrap" else None)
        shell = shell_argv(st_fd, err_fd, limits, self._inside_xfer())
        if self.isolation == "none":
            return shell
        return bwrap_argv(self._bwrap, self.base, self.mounts, self.workdir) + shell

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
        self._status_reader = StatusReader(st_r)
        kind, _value = self._next_status(time.monotonic() + 30.0)
        if kind != "ready":
            out = bytearray()
            drain(self._out, out, 1 << 16)
            self._stop()
            raise SandboxError(f"the sandbox did not start: {bytes(out).decode(errors='replace').strip()[:2000]}")
        kids = process_tree(self._proc.pid)
        if self._cgroup is not None:
            # Every process of the sandbox so far (bwrap, its PID 1, the shell) joins the episode's cgroup
            # now: none has read a command yet, and whatever they start later is born inside it.
            try:
                self._cgroup.adopt([self._proc.pid] + [pid for pid, _start in kids])
            except OSError as e:
                self._stop()
                raise SandboxError(cgroup_refusal(f"moving the sandbox into its cgroup failed: {e}")) from e
        self._supervisor = (self._proc.pid, start_time(self._proc.pid)) if self.isolation == "none" else kids[0]
        if self._num_seeded:
            self._seed.close()
            data = self._seed.fileobj.getvalue()
            self._seed = tarfile.open(fileobj=io.BytesIO(), mode="w")
            self._num_seeded = 0
            res = self.put_tree(data, self.workdir)
            if res.exit_code != 0:
                raise SandboxError(f"copying the episode's files into the sandbox failed: {res.stderr.strip()[:2000]}")

    def _find_driver(self, pid_inside: int) -> None:
        for pid, start in process_tree(self._proc.pid):
            if inner_pid(pid) == pid_inside:
                self._driver = (pid, start)
                return
        self._driver = None

    def _stop(self) -> None:
        """Kill every process of the sandbox (for bwrap: its PID namespace ends with its PID 1)."""
        if self._proc is None:
            return
        procs = process_tree(self._proc.pid)
        if self.isolation == "none":  # the supervisor is the process itself: killed first, it starts no new shell
            procs.insert(0, (self._proc.pid, 0))
        kill_all(procs)  # the sandbox's processes first, so bwrap reaps its PID 1 and exits
        try:
            self._proc.wait(timeout=KILL_GRACE_SEC)
        except subprocess.TimeoutExpired:
            kill_group(self._proc.pid)
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
                tar.extractall(target, filter=export_filter)

    def __enter__(self) -> Self:
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
        return src, (f"{XFER_INSIDE}/{src.name}" if self.isolation == "bwrap" else str(src))

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
        drain(self._out, out, cap)  # what background jobs printed since the last command comes first
        if self.isolation == "bwrap" and self._at_process_limit():
            # an earlier command's background fork bomb grew after that command ended: kill it, and drop
            # what it printed since (its "fork: retry" noise is not this command's output)
            self._kill_new(set())
            time.sleep(0.05)
            drain(self._out, bytearray(), 1 << 30)
            drain(self._err, bytearray(), 1 << 30)
            self._reap_notices(bytearray(), bytearray())
        before = set(process_tree(self._proc.pid))
        oom_before = self._oom_kills()  # above _oom_seen: a background job was killed at the memory cap meanwhile
        if oom_before > self._oom_seen:
            # have the shell take note of that job now, so bash's "Killed ..." notice does not open this command's
            # output (whether bash had already reaped it was a race); the result notes the kill instead
            self._reap_notices(out, err)
        request = encode_request(kind, payload)
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
            drain(self._out, out, cap)
            drain(self._err, err, cap)
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
                kill_all([self._supervisor], signal.SIGSTOP)
                try:
                    self._kill_new(before)
                finally:
                    kill_all([self._supervisor], signal.SIGCONT)
                status = self._collect(time.monotonic() + KILL_GRACE_SEC, out, err, cap, stop_at_cap=False)
            else:
                self._kill_new(before)
                status = self._collect(time.monotonic() + KILL_GRACE_SEC, out, err, cap, before)
        else:
            marks = None
        restarted, lost = self._pending_note
        self._pending_note = (False, False)
        if status is None:  # the shell itself is busy (a builtin loop): kill it, the supervisor starts another
            kill_all(p for p in process_tree(self._proc.pid) if p != self._supervisor)
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
            drain(self._out, out, cap)
            drain(self._err, err, cap)
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
        os.write(self._requests, REAP_REQUEST)  # always written whole to a pipe with room
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
                    drain(fd, out if fd == self._out else err, cap)
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
        while (st := self._status_reader.read_line()) is not None:
            if st[0] == "ready":
                self._find_driver(st[1])
                if keep_ready:
                    return st
            elif st[0] != "reaped" or reaped:
                return st
        return None

    def _at_process_limit(self) -> bool:
        """Is the sandbox running a fork bomb's worth of processes? (BOMB_FRACTION of its limit: far
        more than the background jobs a task leaves, long before the bomb has filled the table)"""
        return len(process_tree(self._proc.pid)) >= BOMB_FRACTION * self.max_processes

    def _kill_new(self, before: set[tuple[int, int]]) -> None:
        """SIGKILL every process of the sandbox that is not the supervisor, the shell or from an earlier command
        (stopped first, in rounds: kill.kill_rounds)."""
        kill_rounds(self._proc.pid, before | {self._supervisor, self._driver})
