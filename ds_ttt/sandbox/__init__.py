"""The one sandbox in which model-written and scripted bash commands run: bubblewrap plus a persistent shell.

    from ds_ttt.sandbox import Sandbox, format_observation

    with Sandbox(timeout=5.0) as sb:                  # refuses (SandboxError) without a working `bwrap`
        sb.write("notes.txt", "hello\\n")            # lands in /app/notes.txt inside
        sb.run("cd sub 2>/dev/null; export N=3")       # one bash per episode: cd, variables, jobs carry over
        result = sb.run("wc -l notes.txt; echo $N")    # CommandResult(output, exit_code, timed_out, ...)
    Sandbox(isolation="none")                          # an explicit choice to run without it (--no-isolation)

Used by the trajectory generator (ds_ttt/data/generator.py), the bash tool runner (ds_ttt/serve/tools.py),
the Harbor environment and agent (ds_ttt/serve/frontends/harbor_env.py, harbor_agent.py) and the closed-loop task
suite (ds_ttt/tasks/, ds_ttt/evaluation/closed_loop.py). docs/sandbox.md says what it protects against
and what it does not; tests/unit/test_sandbox_hostile.py (and tests/harbor/ for Harbor) is the attack
suite behind those claims.

One concept per module, each importing only those listed above it:

  refusal.py     the choices (isolation, cgroup_caps), SandboxError and the refusal messages
  result.py      CommandResult and format_observation (the tool-result text an agent sees)
  kill.py        the sandbox's process tree from /proc; stop-then-kill rounds, process-group kill
  protocol.py    the host <-> shell framing: NUL-terminated requests, status lines
  supervisor.py  the shell code inside: the supervisor (PID 1) and the driver (the persistent bash)
  bwrap.py       the bubblewrap command line: namespaces, read-only system, private tmpfs mounts
  caps.py        the episode's cgroup: memory, processes and CPU capped (v2, v1, systemd)
  files.py       the host side of a sandbox's directory: removal, the safe export filter
  process.py     ShellProcess: one started sandbox process, its pipes, status lines and kills
  command.py     CommandChannel: one command through the episode's shell; the shell's restarts
  shell.py       Shell: one episode's sandbox (options, cgroup, files, commands), isolation unprobed
  probe.py       does isolation (a real sandbox) / a cgroup work here; the choices resolved
  __init__.py    Sandbox: Shell with its isolation resolved by probe.py; the public names below

Import the public names from here; tests that patch a module's global (probe.isolation_problem,
process.KILL_GRACE_SEC, caps.CGROUP_ROOT) patch the module that defines it.
"""

from __future__ import annotations

from .probe import cgroup_problem, isolation_problem, network_isolation_available, resolve_cgroup_caps, resolve_isolation
from .refusal import SandboxError
from .result import CommandResult, format_observation
from .shell import Shell

__all__ = ["CommandResult", "Sandbox", "SandboxError", "cgroup_problem", "format_observation", "isolation_problem",
           "network_isolation_available", "resolve_cgroup_caps", "resolve_isolation"]

class Sandbox(Shell):
    """One episode's sandbox: bwrap, one persistent bash, `run(command)` (shell.py's `Shell`, probed).

    isolation: "required" (default) refuses with `SandboxError` when bwrap does not work here (probe.py);
    "none" runs the same shell without it. `self.isolation` is what is used ("bwrap" or "none"): record it.
    cgroup_caps: "required" (default) puts the whole episode in a cgroup of its own (memory with no swap
    beyond it, processes, CPU: `max_episode_*`) and refuses with `SandboxError` where none can be made;
    "none" runs without. `self.cgroup_caps` is what is used ("cgroup-v2", "cgroup-v1", "systemd" or
    "none"): record it too.
    A context manager: `close()` kills every process of the sandbox, removes its cgroup, and removes
    BASE unless `keep`. The other options, their defaults and the limits: shell.py.
    """

    @staticmethod
    def settle_isolation(isolation: str) -> str:
        return resolve_isolation(isolation)
