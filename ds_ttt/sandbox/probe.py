"""Whether this machine can give a sandbox its protections, probed once per process, and the caller's choices resolved.

    isolation_problem()             # None when bubblewrap sandboxes work here, else why not
    resolve_isolation("required")   # "bwrap", or SandboxError (why, the install command, --no-isolation)
    cgroup_problem()                # None when a per-episode cgroup can be made here, else why not and the fix
    resolve_cgroup_caps("required") # None, or SandboxError before any sandbox is made

The isolation probe starts a real sandbox (`shell.Shell`, which does not probe) and checks what a command
sees inside; the cgroup probe makes and removes a small cgroup (caps.py). `Sandbox` (the package's
__init__) resolves its `isolation` here, so a machine without bubblewrap refuses at the first sandbox;
the generator and the runners call the resolvers up front to refuse before any work, and tests and
setup.sh ask the problems directly.
"""

from __future__ import annotations

import functools
import os
import socket
import time

from .bwrap import SANDBOX_UID, bwrap_path
from .caps import CgroupCaps, CgroupError, create_episode_cgroup
from .refusal import CGROUP_CAPS_CHOICES, ISOLATION_CHOICES, SandboxError, cgroup_refusal, isolation_refusal
from .shell import Shell


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
            with Shell(timeout=10.0, cgroup_caps="none") as sb:  # bwrap, unprobed; no cgroup: only the isolation is probed
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


def resolve_isolation(isolation: str) -> str:
    """What a sandbox will use for the choice `isolation`: "bwrap" or "none". Raises `SandboxError`
    (why, the install command, --no-isolation) when "required" cannot be had, ValueError on a bad choice."""
    if isolation not in ISOLATION_CHOICES:
        raise ValueError(f"isolation={isolation!r}: choose one of {ISOLATION_CHOICES}")
    if isolation == "none":
        return "none"
    problem = isolation_problem()
    if problem is not None:
        raise SandboxError(isolation_refusal(problem))
    return "bwrap"


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
