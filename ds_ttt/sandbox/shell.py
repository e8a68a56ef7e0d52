"""One episode's sandbox as an object: its process, its persistent shell, its files, its commands (`Shell`).

    with Shell(timeout=5.0) as sb:      # what `ds_ttt.sandbox.Sandbox` is, less probing the isolation first
        sb.write("notes.txt", "hi\\n")   # lands in /app/notes.txt inside
        sb.run("cd sub; export N=3")     # CommandResult (result.py); state carries over to the next run()
        sb.run_fresh("ls", cwd="/app")   # a new bash in the same sandbox, stdout and stderr apart

The pieces it puts together, one module each: bwrap.py (the bubblewrap command line), supervisor.py (the
shell code inside), protocol.py (requests and status lines), kill.py (the process tree, killing),
process.py (the started process and its pipes), command.py (one command through the shell, its restarts),
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
exit code 137). The host sees the kill by polling the cgroup's OOM count every process.OOM_POLL_SEC, so a
command line that goes on for less than that after the kill (`hog; echo done`) may finish first: the
result then keeps the line's own exit code and output, and still says that one of its processes was
killed at the cap.
Where no cgroup can be made the sandbox refuses; `cgroup_caps="none"` is the explicit opt-out, and
`self.cgroup_caps` records what was used (both isolations get the cgroup).
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterator, Self

from .bwrap import GROUP_TEXT, HOST_UID_FOR_ROOT, SYSTEM_TMPFS_BYTES, XFER_INSIDE, bwrap_argv, bwrap_path, check_reachable, passwd_text
from .caps import CgroupCaps, CgroupError, EpisodeCgroup, create_episode_cgroup
from .command import CommandChannel
from .files import export_filter, remove_tree
from .process import ShellProcess
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
MAX_TRANSFER_BYTES = 1 << 30  # read() / get_tree()


def put_command(src: str, dst: str, mode: int | None = None) -> str:
    """The shell command of `Shell.put`: copy the file `src` to `dst` (paths inside), its directory made first."""
    q = shlex.quote
    cmd = f'mkdir -p -- "$(dirname -- {q(dst)})" && cat -- {q(src)} > {q(dst)}'
    return cmd + (f" && chmod {mode:o} -- {q(dst)}" if mode is not None else "")


def put_tree_command(src: str, dst: str) -> str:
    """The shell command of `Shell.put_tree`: unpack the tar archive `src` into directory `dst` (paths inside)."""
    return f"mkdir -p -- {shlex.quote(dst)} && tar -xpf {shlex.quote(src)} --no-same-owner -C {shlex.quote(dst)}"


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
        self.isolation = self.settle_isolation(isolation)
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
        self._seed = tarfile.open(fileobj=io.BytesIO(), mode="w")  # files written before the shell starts
        self._num_seeded = 0
        self._num_xfer = 0
        if cgroup_caps == "required":
            self._make_cgroup()
        self.commands = CommandChannel(isolated=self.isolation == "bwrap", max_processes=max_processes, cgroup=self._cgroup,
                                       memory_limit_bytes=self.caps.memory_bytes if self._cgroup is not None else 0)

    @staticmethod
    def settle_isolation(isolation: str) -> str:
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
        """Start the sandbox (process.py waits for the shell's `ready`), then copy in the files written so far."""
        self.commands.process = ShellProcess(self._argv, env=self.env, cwd="/" if self.isolation == "bwrap" else self.root,
                                             isolated=self.isolation == "bwrap", cgroup=self._cgroup, user=self._as_uid)
        if self._num_seeded:
            self._seed.close()
            data = self._seed.fileobj.getvalue()
            self._seed = tarfile.open(fileobj=io.BytesIO(), mode="w")
            self._num_seeded = 0
            res = self.put_tree(data, self.workdir)
            if res.exit_code != 0:
                raise SandboxError(f"copying the episode's files into the sandbox failed: {res.stderr.strip()[:2000]}")

    @property
    def pid(self) -> int | None:
        """The host pid of the sandbox's process (bwrap, or the supervisor without it); None while none runs."""
        return None if self.commands.process is None else self.commands.process.pid

    @property
    def cgroup(self) -> EpisodeCgroup | None:
        """The episode's cgroup (caps.py), None without one (cgroup_caps="none") and after close."""
        return self._cgroup

    @property
    def num_restarts(self) -> int:
        """How many times a new shell was started (the supervisor's, or a whole new sandbox)."""
        return self.commands.num_restarts

    def close(self) -> None:
        try:
            if self.keep and self.isolation == "bwrap" and self.commands.process is not None and self.commands.process.running():
                self._export()
        finally:
            try:
                self.commands.stop()
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
        if self.commands.process is None and self.num_restarts == 0:
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
        if self.commands.process is not None or self.num_restarts:
            raise RuntimeError("add_tree: the sandbox has started; use put_tree")
        self._seed.add(str(host_dir), arcname=".")
        self._num_seeded += 1

    @contextlib.contextmanager
    def staged(self, *blobs: bytes) -> Iterator[list[str]]:
        """Each blob as a read-only file the sandbox's commands can read (their paths inside, in order),
        removed on leaving: the uploads of `put`, `put_tree`, or of one `run_fresh` that places several
        (put_command, put_tree_command)."""
        files = []
        try:
            for data in blobs:
                self._num_xfer += 1
                src = self.base / "xfer" / f"in-{self._num_xfer}"
                files.append(src)
                src.write_bytes(data)
                os.chmod(src, 0o644)
            yield [f"{XFER_INSIDE}/{src.name}" if self.isolation == "bwrap" else str(src) for src in files]
        finally:
            for src in files:
                src.unlink(missing_ok=True)

    def put(self, data: bytes, target: str, mode: int | None = None) -> CommandResult:
        """Copy `data` to `target` (a path inside, resolved inside the sandbox)."""
        with self.staged(data) as (inside,):
            return self.run_fresh(put_command(inside, self._inside(target), mode), timeout=max(self.timeout, 60.0))

    def put_tree(self, tar_data: bytes, target_dir: str) -> CommandResult:
        """Unpack a tar archive into `target_dir` (inside; made if missing)."""
        with self.staged(tar_data) as (inside,):
            return self.run_fresh(put_tree_command(inside, self._inside(target_dir)), timeout=max(self.timeout, 60.0))

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
        """Send one command to the persistent shell (command.py), (re)starting the sandbox first if needed."""
        if "\0" in payload:
            return CommandResult(command, "[error: the command contains a NUL byte]", 2)
        self.commands.drop_dead_process()
        if self.commands.process is None:
            self._start()
        return self.commands.run(kind, payload, command, self.timeout if timeout is None else timeout,
                                 self.max_output_bytes if max_output_bytes is None else max_output_bytes)
