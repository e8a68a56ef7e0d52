"""One started sandbox process, from the host: its pipes, its status lines, its supervisor and shell, its kills.

    proc = ShellProcess(argv_for, env=env, cwd="/", isolated=True, cgroup=group)  # returns once the shell is ready
    proc.send(encode_request("shell", "make"))    # protocol.py's framing, written as the shell reads
    proc.collect(out, err, cap, deadline=t)       # ("status", 0) | ("exit", 3) | ... | None at the deadline / cap
    proc.kill_new(before)                         # what the command started, not the supervisor or the shell
    proc.stop()                                   # every process of the sandbox; the pipes closed

`argv_for(status_fd, stderr_fd)` is the whole command line (bwrap.py + supervisor.py; the cgroup wraps it
where it has to start inside a systemd scope), given the fds the status and stderr pipes have in the child: the shell inside writes "ready <pid>" on the status pipe once it runs, and the
host then moves every process so far into the episode's cgroup. The host names the supervisor (PID 1 of
the sandbox, or the process itself without bwrap) and the driver (the episode's bash, found again at each
"ready") by (host pid, start time), so the kills spare them and the processes of earlier commands.

`Shell` (shell.py) owns the episode (its options, files and cgroup) and starts one of these, again after
the sandbox had to be stopped; command.py drives one command through it.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import time
from typing import Callable

from .caps import EpisodeCgroup
from .kill import inner_pid, kill_all, kill_group, kill_rounds, process_tree, start_time
from .protocol import StatusReader, drain
from .refusal import SandboxError, cgroup_refusal

OOM_POLL_SEC = 0.05  # while a command runs, how often the host looks for an OOM kill in the cgroup
START_TIMEOUT_SEC = 30.0  # how long a new sandbox has to say "ready"
KILL_GRACE_SEC = 2.0  # after a kill, how long the shell has to report (and the process to exit at a stop)


class ShellProcess:
    """The sandbox's process (bwrap, or the supervisor itself without isolation) and the four pipes to it.

    requests: the shell's stdin (protocol.py's requests); status: its status lines; out: the commands'
    output (stderr merged for "shell" requests); err: the stderr of "fresh" requests. All but requests are
    non-blocking. `supervisor` and `driver` are (host pid, start time), `driver` None while no shell runs.
    """

    def __init__(self, argv_for: Callable[[int, int], list[str]], *, env: dict[str, str], cwd: str | os.PathLike, isolated: bool,
                 cgroup: EpisodeCgroup | None = None, user: int | None = None):
        self.cgroup, self.isolated = cgroup, isolated
        self.driver: tuple[int, int] | None = None
        pipes = [os.pipe() for _ in range(4)]  # requests, status, output, fresh stderr
        (req_r, req_w), (st_r, st_w), (out_r, out_w), (err_r, err_w) = pipes
        # the status and stderr pipes reach the supervisor as fds >= 10; it moves them to 3 and 4
        st_child, err_child = fcntl.fcntl(st_w, fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(err_w, fcntl.F_DUPFD_CLOEXEC, 10)
        argv = argv_for(st_child, err_child)
        if cgroup is not None:
            argv = cgroup.wrap(argv)  # systemd: the process starts inside a new scope
        as_user = {} if user is None else {"user": user, "group": user, "extra_groups": []}
        try:
            self.popen = subprocess.Popen(argv, stdin=req_r, stdout=out_w, stderr=out_w, env=env, cwd=cwd,
                                          start_new_session=True, pass_fds=(st_child, err_child), **as_user)
        except OSError as e:
            raise SandboxError(f"could not start the sandbox ({argv[0]}): {e}") from e
        finally:
            for fd in (req_r, st_w, out_w, err_w, st_child, err_child):
                os.close(fd)
        self.pid = self.popen.pid
        for fd in (st_r, out_r, err_r):
            os.set_blocking(fd, False)
        self.requests, self.status, self.out, self.err = req_w, st_r, out_r, err_r
        self.status_reader = StatusReader(st_r)
        self.stopped = False
        kind, _value = self.next_status(time.monotonic() + START_TIMEOUT_SEC)
        if kind != "ready":
            out = bytearray()
            drain(self.out, out, 1 << 16)
            self.stop()
            raise SandboxError(f"the sandbox did not start: {bytes(out).decode(errors='replace').strip()[:2000]}")
        kids = self.tree()
        if cgroup is not None:
            # Every process of the sandbox so far (bwrap, its PID 1, the shell) joins the episode's cgroup
            # now: none has read a command yet, and whatever they start later is born inside it.
            try:
                cgroup.adopt([self.pid] + [pid for pid, _start in kids])
            except OSError as e:
                self.stop()
                raise SandboxError(cgroup_refusal(f"moving the sandbox into its cgroup failed: {e}")) from e
        self.supervisor = kids[0] if isolated else (self.pid, start_time(self.pid))

    # ---- the processes -----------------------------------------------------------------------------
    def running(self) -> bool:
        return self.popen.poll() is None

    def tree(self) -> list[tuple[int, int]]:
        """(host pid, start time) of every process of the sandbox below the process itself."""
        return process_tree(self.pid)

    def find_driver(self, pid_inside: int) -> None:
        for pid, start in self.tree():
            if inner_pid(pid) == pid_inside:
                self.driver = (pid, start)
                return
        self.driver = None

    def interrupt(self) -> None:
        """SIGUSR1 to the shell: its trap abandons the command line (sent before the command's processes are killed)."""
        if self.driver is not None:
            try:
                os.kill(self.driver[0], signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def signal_supervisor(self, sig: int) -> None:
        """SIGSTOP / SIGCONT to the supervisor (a PID 1 ignores signals from inside, not these from the host)."""
        kill_all([self.supervisor], sig)

    def kill_shell(self) -> None:
        """SIGKILL every process but the supervisor, the shell included: the supervisor starts another."""
        kill_all(p for p in self.tree() if p != self.supervisor)

    def kill_new(self, before: set[tuple[int, int]]) -> None:
        """SIGKILL every process of the sandbox that is not the supervisor, the shell or from an earlier command
        (stopped first, in rounds: kill.kill_rounds)."""
        kill_rounds(self.pid, before | {self.supervisor, self.driver})

    def stop(self) -> None:
        """Kill every process of the sandbox (for bwrap: its PID namespace ends with its PID 1) and close the
        pipes; the process has KILL_GRACE_SEC to exit before its whole process group is killed."""
        if self.stopped:
            return
        procs = self.tree()
        if not self.isolated:  # the supervisor is the process itself: killed first, it starts no new shell
            procs.insert(0, (self.pid, 0))
        kill_all(procs)  # the sandbox's processes first, so bwrap reaps its PID 1 and exits
        try:
            self.popen.wait(timeout=KILL_GRACE_SEC)
        except subprocess.TimeoutExpired:
            kill_group(self.pid)
            self.popen.wait()
        for fd in (self.requests, self.status, self.out, self.err):
            os.close(fd)
        self.stopped = True

    # ---- the pipes ---------------------------------------------------------------------------------
    def send(self, request: bytes) -> None:
        """Write one request; the shell reads as we write, so a long command needs more than one pipe buffer."""
        while request:
            select.select([], [self.requests], [])
            request = request[os.write(self.requests, request):]

    def drain(self, out: bytearray, err: bytearray, cap: int) -> None:
        """What the commands printed so far, into `out` and `err` (at most cap + 1 bytes each)."""
        drain(self.out, out, cap)
        drain(self.err, err, cap)

    def collect(self, out: bytearray, err: bytearray, cap: int, *, deadline: float | None = None,
                before: set | None = None, stop_at_cap: bool = True,
                reaped: bool = False, oom_from: int | None = None) -> tuple[str, int] | None:
        """Read output until the shell reports ("status"|"exit", code), or with `reaped` also ("reaped", 0)
        (else that answer is skipped); None at the deadline (None: KILL_GRACE_SEC from now, the wait after
        a kill) or past the cap (with `before` given, keep killing what the command started while waiting);
        with `oom_from`, ("oom", 0) as soon as the cgroup's OOM-kill count is above it (looked at every
        OOM_POLL_SEC)."""
        deadline = time.monotonic() + KILL_GRACE_SEC if deadline is None else deadline
        fds = [self.out, self.err, self.status]
        stop_at_cap = stop_at_cap and before is None
        wake = 0.05 if before is not None else (OOM_POLL_SEC if oom_from is not None else None)
        next_oom_check = time.monotonic() + OOM_POLL_SEC
        while True:
            st = self.pop_status(reaped=reaped)
            if st is not None:
                return st
            now = time.monotonic()
            left = deadline - now
            if left <= 0 or (stop_at_cap and len(out) + len(err) > cap):
                return None
            if oom_from is not None and now >= next_oom_check:
                next_oom_check = now + OOM_POLL_SEC
                if self.cgroup.oom_kills() > oom_from:
                    return ("oom", 0)
            for fd in select.select(fds, [], [], left if wake is None else min(left, wake))[0]:
                if fd != self.status:  # a status line is taken at the top of the loop
                    drain(fd, out if fd == self.out else err, cap)
            if before is not None:
                self.kill_new(before)

    def next_status(self, deadline: float | None = None) -> tuple[str, int] | tuple[None, None]:
        """The next line of the status pipe, "ready" included (a late reap answer is skipped); (None, None)
        at the deadline (None: KILL_GRACE_SEC from now)."""
        deadline = time.monotonic() + KILL_GRACE_SEC if deadline is None else deadline
        while True:
            st = self.pop_status(keep_ready=True)
            if st is not None:
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                return None, None
            select.select([self.status], [], [], left)

    def pop_status(self, *, reaped: bool = False, keep_ready: bool = False) -> tuple[str, int] | None:
        """The next status line for the caller, None when no complete line has arrived. Every complete
        line is looked at, buffered ones first (two lines can come in one read: a skipped one must not
        leave the next waiting in the buffer while the caller waits on the pipe): "ready" records the
        new shell's pid (and is returned with `keep_ready`), "reaped" is skipped unless asked for."""
        while (st := self.status_reader.read_line()) is not None:
            if st[0] == "ready":
                self.find_driver(st[1])
                if keep_ready:
                    return st
            elif st[0] != "reaped" or reaped:
                return st
        return None
