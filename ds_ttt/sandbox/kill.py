"""Finding and killing a sandbox's processes from the host: its process tree read from /proc, stop-then-kill rounds.

    procs = process_tree(root_pid)             # [(pid, start time), ...]: every descendant, threads' children too
    kill_all(procs, signal.SIGSTOP)            # signal each; one already gone (or not ours) is skipped
    kill_rounds(root_pid, keep=before | {supervisor, shell})   # what a command started: stopped, then killed
    kill_group(pid)                            # the last resort: SIGKILL its whole process group

A process is named by (pid, start time), so a pid reused by a new process is never mistaken for an old
one. `shell.py` uses these at a timeout, at the output cap, after an OOM kill, against a fork bomb and at
`close`; the host sees the sandbox's processes by their host pids (`inner_pid` maps one to the pid it
has inside the sandbox's PID namespace).
"""

from __future__ import annotations

import os
import signal
import time

KILL_ROUNDS_SEC = 3.0  # how long a command's leftover processes are stopped and killed, round after round


def process_tree(root_pid: int) -> list[tuple[int, int]]:
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
                out.append((k, start_time(k)))
                stack.append(k)
    return out


def start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def inner_pid(pid: int) -> int | None:
    """The PID that host process `pid` has in its innermost PID namespace (NSpid's last entry)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def kill_all(procs, sig: int = signal.SIGKILL) -> None:
    for pid, _start in procs:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_rounds(root_pid: int, keep: set) -> None:
    """SIGKILL every process under root_pid that is not in `keep`.

    A fork bomb refills the process table as fast as processes die, so each round first stops
    (SIGSTOP) every victim, which can then fork no more, and only then kills them; rounds repeat
    until none is left or KILL_ROUNDS_SEC has passed."""
    deadline = time.monotonic() + KILL_ROUNDS_SEC
    while time.monotonic() < deadline:
        victims = [p for p in process_tree(root_pid) if p not in keep]
        if not victims:
            return
        kill_all(victims, signal.SIGSTOP)
        kill_all(victims)
        time.sleep(0.002)


def kill_group(pid: int) -> None:
    """SIGKILL the process group that `pid` leads (a sandbox is started in a session of its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
