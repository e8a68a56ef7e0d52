"""Throwaway sandbox directories in which the generator runs real bash commands.

Each command runs as `bash --noprofile --norc -c CMD` with the sandbox as working directory and HOME,
a minimal environment (C locale, fixed PATH, no proxies), a timeout, stdin from /dev/null, and — where
the kernel allows unprivileged user namespaces — inside `unshare -rn`, i.e. with no network at all.
Only the generator's own commands run here. The observation is the real combined stdout+stderr.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
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


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """True when `unshare -rn` works here (unprivileged user + network namespaces)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class CommandResult:
    command: str
    output: str
    exit_code: int
    timed_out: bool = False


class Sandbox:
    """A temporary directory plus `run(command)`; use as a context manager (removed on exit unless kept)."""

    def __init__(self, parent: str | None = None, keep: bool = False, timeout: float = 5.0, isolate_network: bool = True):
        self.root = Path(tempfile.mkdtemp(prefix="ds_ttt_sbx_", dir=parent))
        self.keep = keep
        self.timeout = timeout
        self.isolate = isolate_network and network_isolation_available()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def write(self, rel: str, text: str, mode: int | None = None) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if mode is not None:
            os.chmod(path, mode)

    def run(self, command: str) -> CommandResult:
        argv = ["bash", "--noprofile", "--norc", "-c", command]
        if self.isolate:
            argv = ["unshare", "-rn"] + argv
        env = dict(SANDBOX_ENV, HOME=str(self.root))
        try:
            proc = subprocess.run(argv, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode("utf-8", "replace")
            return CommandResult(command, out, 124, timed_out=True)
        return CommandResult(command, proc.stdout.decode("utf-8", "replace"), proc.returncode)


def format_observation(result: CommandResult, max_chars: int = 2000) -> str:
    """The tool-result text the agent sees: the real output, trimmed of trailing newlines, with the exit
    status appended when non-zero (and a note when the command timed out or the output was cut)."""
    out = result.output.rstrip("\n")
    if len(out) > max_chars:
        out = out[:max_chars] + f"\n[output truncated: {len(result.output)} chars]"
    if result.timed_out:
        out += ("\n" if out else "") + "[command timed out]"
    elif result.exit_code != 0:
        out += ("\n" if out else "") + f"[exit code: {result.exit_code}]"
    return out if out else "(no output)"
