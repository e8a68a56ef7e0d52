"""One command through the episode's shell, and the shell's restarts across commands (`CommandChannel`).

    channel = CommandChannel(isolated=True, max_processes=256, cgroup=group, memory_limit_bytes=4 << 30)
    channel.process = ShellProcess(...)                      # shell.py starts it (and again after a stop)
    res = channel.run("shell", "make", "make", timeout=5.0, cap=1 << 20)   # CommandResult (result.py)

A command is one request (protocol.py) and one status back. Around it: what background jobs printed since
the last command comes first; a background fork bomb's leftovers are killed before it starts; at the
timeout or the output cap the shell abandons the command line (SIGUSR1) and every process the command
started is killed (process.py's `kill_new`, sparing the supervisor, the shell and the jobs of earlier
commands); an OOM kill in the episode's cgroup stops the command as a timeout does; a shell that exited
or hung is replaced by the supervisor, and one that cannot be replaced stops the sandbox (its files are
lost: the next command starts a new one, and its result says so); a fork bomb left behind is killed.

`Shell` (shell.py) owns the channel and starts its process; `num_restarts` counts every new shell.
"""

from __future__ import annotations

import signal
import time

from .caps import EpisodeCgroup
from .process import ShellProcess
from .protocol import REAP_REQUEST, drain, encode_request
from .result import CommandResult

BOMB_FRACTION = 0.25  # leftover processes at or above this share of max_processes are killed as a fork bomb
LIMIT_RECHECK_SEC = 0.02  # a background bomb below the limit when its command ends is there this much later


class CommandChannel:
    """The episode's commands, one at a time, through its `ShellProcess` (None until started, and again once
    the sandbox had to be stopped). isolated: bwrap is used (the process limit holds, a stop loses the files).
    memory_limit_bytes: the cgroup's memory cap, for the results' notes (0 without a cgroup)."""

    def __init__(self, *, isolated: bool, max_processes: int, cgroup: EpisodeCgroup | None, memory_limit_bytes: int):
        self.isolated, self.max_processes = isolated, max_processes
        self.cgroup, self.memory_limit_bytes = cgroup, memory_limit_bytes
        self.process: ShellProcess | None = None
        self.num_restarts = 0
        self.pending_note = (False, False)  # (shell restarted, files lost) to report with the next result
        self.oom_seen = self.oom_kills()  # the cgroup's OOM-kill count when the last result was made

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def stop(self) -> None:
        """Kill every process of the sandbox; the next command needs a new process."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def drop_dead_process(self) -> None:
        """The sandbox's process ended on its own (cannot happen short of a kernel OOM kill: PID 1 ignores
        signals from inside): stop it, and say so with the next result."""
        if self.process is not None and not self.process.running():
            self.stop()
            self.pending_note = (True, self.isolated)
            self.num_restarts += 1

    def at_process_limit(self) -> bool:
        """Is the sandbox running a fork bomb's worth of processes? (BOMB_FRACTION of its limit: far
        more than the background jobs a task leaves, long before the bomb has filled the table)"""
        return len(self.process.tree()) >= BOMB_FRACTION * self.max_processes

    def run(self, kind: str, payload: str, command: str, timeout: float, cap: int) -> CommandResult:
        """Send one request to the started shell and collect its result: drop a background fork bomb's
        leftovers, write the request, read until the status, stop it at the timeout or the output cap,
        recover a shell that died or hung, check the process limit.

        One function on purpose: these steps share the output buffers, the process set from before the
        command and the stop marks, and their order is the protocol with the shell (what is drained
        when, what is killed before what), which reads best in one place."""
        out, err = bytearray(), bytearray()
        drain(self.process.out, out, cap)  # what background jobs printed since the last command comes first
        if self.isolated and self.at_process_limit():
            # an earlier command's background fork bomb grew after that command ended: kill it, and drop
            # what it printed since (its "fork: retry" noise is not this command's output)
            self.process.kill_new(set())
            time.sleep(0.05)
            self.process.drain(bytearray(), bytearray(), 1 << 30)
            self.reap_notices(bytearray(), bytearray())
        before = set(self.process.tree())
        oom_before = self.oom_kills()  # above oom_seen: a background job was killed at the memory cap meanwhile
        if oom_before > self.oom_seen:
            # have the shell take note of that job now, so bash's "Killed ..." notice does not open this command's
            # output (whether bash had already reaped it was a race); the result notes the kill instead
            self.reap_notices(out, err)
        self.process.send(encode_request(kind, payload))
        deadline = time.monotonic() + timeout
        timed_out = truncated = False
        status = self.process.collect(out, err, cap, deadline=deadline,
                                      oom_from=oom_before if self.cgroup is not None else None)
        memory_hit = status == ("oom", 0)  # the kernel killed a process at the memory cap: stop the command
        if status is None or memory_hit:
            status = None
            timed_out = not memory_hit and len(out) + len(err) <= cap
            truncated = not memory_hit and not timed_out
            self.process.drain(out, err, cap)
            marks = (len(out), len(err))  # what the command printed before it was stopped is its output
            self.process.interrupt()  # first, so the shell abandons the command line
            if memory_hit:
                # The OOM killer may have taken the shell itself (a command substitution holds its output in
                # the shell). The supervisor would then start a new shell, which the kill rounds must not
                # take for one of the command's processes: it is stopped (SIGSTOP reaches a PID 1 from the
                # host) until they are done, then reports the old shell's exit, if it ended, and starts one.
                self.process.signal_supervisor(signal.SIGSTOP)
                try:
                    self.process.kill_new(before)
                finally:
                    self.process.signal_supervisor(signal.SIGCONT)
                status = self.process.collect(out, err, cap, stop_at_cap=False)
            else:
                self.process.kill_new(before)
                status = self.process.collect(out, err, cap, before=before)
        else:
            marks = None
        restarted, lost = self.pending_note
        self.pending_note = (False, False)
        if status is None:  # the shell itself is busy (a builtin loop): kill it, the supervisor starts another
            self.process.kill_shell()
            status = self.process.collect(out, err, cap, stop_at_cap=False)
            if status is None or status[0] != "exit":
                self.stop()
                lost = self.isolated
            restarted = True
            self.num_restarts += 1
        elif status[0] == "exit":
            restarted = True
            self.num_restarts += 1
        if restarted and self.process is not None:
            kind_, value = self.process.next_status()
            if kind_ == "ready":
                self.process.find_driver(value)
            else:
                self.stop()
                lost = self.isolated
        if marks is not None and not restarted and self.process is not None:
            self.reap_notices(out, err)  # the jobs killed at the stop (cut below with the rest after it)
        oom_after = self.oom_kills()
        memory_hit = memory_hit or oom_after > oom_before  # also: one of its processes died at the cap as it ended
        if memory_hit and (marks is None or restarted) and self.process is not None:
            self.process.kill_new(before)  # what the command left (its shell may have been the one killed)
            if not restarted:
                time.sleep(0.05)
                self.reap_notices(out, err)
        memory_earlier, self.oom_seen = oom_before > self.oom_seen, oom_after
        at_limit = False
        if self.process is not None and self.isolated and (
                self.at_process_limit() or (time.sleep(LIMIT_RECHECK_SEC) is None and self.at_process_limit())):
            at_limit = True  # a fork bomb in the background would hold the sandbox at its limit for good
            self.process.kill_new(before)
            time.sleep(0.05)  # let the dying processes' last output arrive
            self.reap_notices(out, err)
        if self.process is not None:
            self.process.drain(out, err, cap)
        if marks is not None:  # drop what came after the stop (bash's "Killed" notes, the trap's leftovers)
            del out[marks[0]:], err[marks[1]:]
        truncated = truncated or len(out) + len(err) > cap
        code = 124 if timed_out else 137 if memory_hit and marks is not None else (status[1] if status is not None else 137)
        raw = bytes(out[:cap])
        return CommandResult(command, raw.decode("utf-8", "replace"), code, timed_out=timed_out,
                             output_truncated=truncated, output_bytes=len(out), shell_restarted=restarted,
                             files_lost=lost, stderr=bytes(err[:cap]).decode("utf-8", "replace"), raw=raw,
                             process_limit_hit=at_limit, memory_limit_hit=memory_hit, memory_limit_earlier=memory_earlier,
                             memory_limit_bytes=self.memory_limit_bytes)

    def reap_notices(self, out: bytearray, err: bytearray) -> None:
        """Have the shell take note of the jobs the host just killed, so its "Killed" notices are not
        printed into the next command's output (the result already says the sandbox killed them).
        What background jobs print meanwhile goes to `out`/`err`. The answer ("reaped") is waited for
        up to the grace time; one that comes later (a machine under heavy load) is skipped wherever it
        arrives, so a slow reap costs at most a notice, never a command's status. If the shell ended
        meanwhile, the supervisor's new shell is awaited and the next result says it was restarted."""
        self.process.send(REAP_REQUEST)  # always written whole to a pipe with room
        status = self.process.collect(out, err, 1 << 30, stop_at_cap=False, reaped=True)
        if status is not None and status[0] == "exit":
            self.num_restarts += 1
            kind, _value = self.process.next_status()
            lost = kind != "ready"
            if lost:
                self.stop()
            self.pending_note = (True, lost and self.isolated)
