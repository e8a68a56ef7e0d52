"""The sandbox's two choices and its refusals: what a caller may choose, and what it is told when a choice cannot be had.

    Sandbox(isolation="required" | "none", cgroup_caps="required" | "none")
    raise SandboxError(isolation_refusal("`bwrap` is not on PATH"))    # why, the install command, --no-isolation
    raise SandboxError(cgroup_refusal(str(cgroup_error)))              # why and the fix (the CgroupError's text)

"required" (the default of both) refuses where the protection cannot be had; "none" is the explicit
opt-out, recorded by the callers (meta.isolation, meta.cgroup_caps, the runner's summary). Used by
`probe.py` (resolving a choice before any sandbox is made), `shell.py` (refusing while making one) and
`bwrap.py`; `SandboxError` is what every caller catches.
"""

from __future__ import annotations

ISOLATION_CHOICES = ("required", "none")
CGROUP_CAPS_CHOICES = ("required", "none")  # "none": no per-episode cgroup (--no-cgroup-caps), recorded
INSTALL_HINT = "apt-get install bubblewrap (setup.sh does this)"


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command): bwrap missing or broken, or its setup failed."""


def isolation_refusal(problem: str) -> str:
    return (f"the sandbox is unavailable here: {problem}. Install bubblewrap ({INSTALL_HINT}). To run commands "
            f"without it, with this machine's network, files and process table, pass --no-isolation "
            f"(data_prep/generate.py, the serve runner) or Sandbox(isolation='none') / generate(..., isolation='none').")


def cgroup_refusal(problem: str) -> str:
    return f"the sandbox cannot cap the episode's memory, processes and CPU here: {problem}"
